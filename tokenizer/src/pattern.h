// The {"String": ...} / {"Regex": ...} pattern objects of Replace and Split.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/regex.h"

namespace tgis::tok {

class Pattern {
 public:
  static absl::StatusOr<Pattern> FromJson(const Json& j, const std::string& path);
  std::vector<MatchSpan> FindMatches(std::string_view text) const {
    return regex_ ? regex_->FindMatches(text) : MatchLiteral(text, literal_);
  }

 private:
  std::string literal_;
  std::shared_ptr<Regex> regex_;
};

}  // namespace tgis::tok

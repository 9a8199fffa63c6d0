// Oniguruma-backed regular expressions: HF tokenizers compiles tokenizer.json patterns with
// Oniguruma too, so using the same engine keeps Unicode classes and lookarounds identical.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/src/normalized_string.h"

namespace tgis::tok {

class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches, leftmost first, as [start, end) byte pairs; an empty match right
  // after the previous match is skipped (the onig crate's find_iter rule).
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;
  // Matches and the gaps between them covering all of text (HF's Pattern contract).
  std::vector<MatchSpan> FindMatches(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  Regex() = default;
  void* regex_ = nullptr;  // OnigRegex; kept opaque so oniguruma.h stays out of headers
  std::string pattern_;
};

}  // namespace tgis::tok

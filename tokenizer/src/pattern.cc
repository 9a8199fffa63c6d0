#include "tokenizer/src/pattern.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace tgis::tok {

absl::StatusOr<Pattern> Pattern::FromJson(const Json& j, const std::string& path) {
  Pattern p;
  if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    p.literal_ = j["String"].get<std::string>();
    return p;
  }
  if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    auto re = Regex::Compile(j["Regex"].get<std::string>());
    if (!re.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", re.status().message()));
    p.regex_ = std::move(*re);
    return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": expected {\"String\": ...} or {\"Regex\": ...}"));
}

}  // namespace tgis::tok

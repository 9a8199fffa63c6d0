// SentencePiece's precompiled normalization map (the Precompiled normalizer of T5-style
// tokenizer.json files): a darts-clone double-array trie over UTF-8 input whose values index
// NUL-terminated replacement strings.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::tok {

class PrecompiledCharsMap {
 public:
  static absl::StatusOr<PrecompiledCharsMap> Parse(std::string_view blob);
  // The replacement for the shortest trie entry that prefixes `chunk` (HF's rule), if any.
  std::optional<std::string_view> Transform(std::string_view chunk) const;
  bool empty() const { return trie_.empty(); }

 private:
  std::vector<uint32_t> trie_;
  std::string normalized_;
};

absl::StatusOr<std::string> Base64Decode(std::string_view in);

}  // namespace tgis::tok

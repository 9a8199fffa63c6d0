// GPT-2 style tokenizer files (vocab.json + merges.txt, as GPT2Tokenizer saves them, with no
// tokenizer.json: OPT's repositories, older GPT-2 derivatives) turned into the tokenizer.json
// that transformers' GPT2Converter makes of them when it loads them as a fast tokenizer (what
// TGIS's launcher does through Python before it starts the router).
#pragma once

#include <filesystem>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tgis::tok {

// True when `dir` holds vocab.json and merges.txt.
bool HasGpt2Files(const std::filesystem::path& dir);

// `config`: tokenizer_config.json (empty object when absent); `special_map`:
// special_tokens_map.json. A tokenizer_class other than GPT-2's is refused by name: other
// converters (RoBERTa's, BART's) add different post-processing.
absl::StatusOr<nlohmann::json> Gpt2FilesToTokenizerJson(const std::filesystem::path& dir,
                                                        const nlohmann::json& config,
                                                        const nlohmann::json& special_map);

}  // namespace tgis::tok

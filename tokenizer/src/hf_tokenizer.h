#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"

namespace tgis::tok {

// A tokenizer.json pipeline. `file` names the file in error messages.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& file);
// The same from a parsed tokenizer.json; `where` names its source in error messages.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizerJson(const nlohmann::json& root,
                                                               const std::string& where);
// A SentencePiece .model file; add_bos / add_eos as tokenizer_config.json says.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSpTokenizer(const std::string& file, bool add_bos,
                                                           bool add_eos);
// Set by EnableSentencePieceModels() (tokenizer/sentencepiece.h); null in programs without it.
using SpLoader = absl::StatusOr<std::unique_ptr<Tokenizer>> (*)(const std::string&, bool, bool);
SpLoader& SentencePieceLoader();

}  // namespace tgis::tok

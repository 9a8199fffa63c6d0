// Prompt tokenization as the router needs it, the same for Generate and Tokenize (so that
// Tokenize's token_count equals Generate's input_token_count for the same text).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace tgis::router {

// Encodes `text` with the tokenizer's special tokens (as TGIS does). When `truncate_to` is
// non-zero and smaller than the token count, only the last tokens of the text are kept, and the
// special tokens the tokenizer adds around it (e.g. a leading BOS) stay in place: the result is
// what HF tokenizers give when truncating from the left to `truncate_to` tokens, which is what
// TGIS's shards feed the model. `untruncated_length`, when given, gets the token count before
// truncation.
absl::StatusOr<Encoding> EncodeInput(const Tokenizer& tokenizer, std::string_view text,
                                     uint32_t truncate_to, size_t* untruncated_length = nullptr);

// Tokenize's truncation, as TGIS's Tokenize does it: the plain tail of the full encoding (a
// leading BOS is cut like any other token), unlike Generate's (EncodeInput).
absl::StatusOr<Encoding> EncodeTail(const Tokenizer& tokenizer, std::string_view text,
                                    uint32_t truncate_to);

}  // namespace tgis::router

// Prompt tokenization as the router needs it, the same for Generate and Tokenize (so that
// Tokenize's token_count equals Generate's input_token_count for the same text).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
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

// For an input far longer in bytes than `max_tokens` tokens could be (over 64 bytes per token
// and 64 KiB), the token count of a prefix of it (about 16 bytes per token, cut just before a
// whitespace that ends a word) when that count alone reaches `max_tokens`; otherwise nothing,
// and only the whole text can tell. The prefix's words are whole words of the text, so its
// tokens are the first tokens of the text's and the text has at least as many: an input that
// cannot fit is refused without tokenizing all of it (up to 4 MiB: seconds of work).
std::optional<size_t> TokensOfLongPrefix(const Tokenizer& tokenizer, std::string_view text,
                                         size_t max_tokens);

// Tokenize's truncation, as TGIS's Tokenize does it: the plain tail of the full encoding (a
// leading BOS is cut like any other token), unlike Generate's (EncodeInput).
absl::StatusOr<Encoding> EncodeTail(const Tokenizer& tokenizer, std::string_view text,
                                    uint32_t truncate_to);

}  // namespace tgis::router

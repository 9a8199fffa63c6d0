#include "router/input_encoding.h"

#include <algorithm>

namespace tgis::router {
namespace {

// Appends tokens [begin, end) of `from` to `to`.
void AppendRange(const Encoding& from, size_t begin, size_t end, Encoding* to) {
  to->ids.insert(to->ids.end(), from.ids.begin() + begin, from.ids.begin() + end);
  to->tokens.insert(to->tokens.end(), from.tokens.begin() + begin, from.tokens.begin() + end);
  to->offsets.insert(to->offsets.end(), from.offsets.begin() + begin, from.offsets.begin() + end);
}

Encoding LastTokens(const Encoding& e, size_t n) {
  Encoding out;
  AppendRange(e, e.ids.size() - n, e.ids.size(), &out);
  return out;
}

}  // namespace

absl::StatusOr<Encoding> EncodeInput(const Tokenizer& tokenizer, std::string_view text,
                                     uint32_t truncate_to, size_t* untruncated_length) {
  absl::StatusOr<Encoding> full = tokenizer.Encode(text, /*add_special_tokens=*/true);
  if (full.ok() && untruncated_length != nullptr) *untruncated_length = full->ids.size();
  if (!full.ok() || truncate_to == 0 || full->ids.size() <= truncate_to) return full;

  // Find where the text's own tokens sit between the added special tokens.
  absl::StatusOr<Encoding> bare = tokenizer.Encode(text, /*add_special_tokens=*/false);
  if (!bare.ok()) return bare.status();
  const size_t n = bare->ids.size();
  const size_t total = full->ids.size();
  size_t prefix = total;  // not found
  for (size_t p = 0; n > 0 && p + n <= total; ++p) {
    if (std::equal(bare->ids.begin(), bare->ids.end(), full->ids.begin() + p)) {
      prefix = p;
      break;
    }
  }
  if (prefix == total) {
    // A post-processor that rewrites the text's tokens: keep the last tokens of the whole.
    return LastTokens(*full, truncate_to);
  }
  // As HF truncation, the text's tokens go first; the special tokens stay even when they alone
  // reach the limit.
  const size_t specials = total - n;
  const size_t keep = truncate_to > specials ? truncate_to - specials : 0;
  Encoding out;
  AppendRange(*full, 0, prefix, &out);
  AppendRange(*full, prefix + n - keep, total, &out);
  return out;
}

std::optional<size_t> TokensOfLongPrefix(const Tokenizer& tokenizer, std::string_view text,
                                         size_t max_tokens) {
  constexpr size_t kTryBytesPerToken = 64;
  constexpr size_t kMinTryBytes = 64 << 10;
  constexpr size_t kPrefixBytesPerToken = 16;
  if (max_tokens == 0 || max_tokens > text.size() / kTryBytesPerToken ||
      text.size() <= kMinTryBytes) {
    return std::nullopt;
  }
  auto space = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  // Just before a whitespace that follows a word (ASCII whitespace is never inside a UTF-8
  // sequence, so this is a character boundary).
  size_t cut = kPrefixBytesPerToken * max_tokens;
  while (cut > 0 && !(space(text[cut]) && !space(text[cut - 1]))) --cut;
  if (cut == 0) return std::nullopt;
  absl::StatusOr<Encoding> prefix = tokenizer.Encode(text.substr(0, cut), true);
  if (!prefix.ok() || prefix->ids.size() < max_tokens) return std::nullopt;
  return prefix->ids.size();
}

absl::StatusOr<Encoding> EncodeTail(const Tokenizer& tokenizer, std::string_view text,
                                    uint32_t truncate_to) {
  absl::StatusOr<Encoding> full = tokenizer.Encode(text, /*add_special_tokens=*/true);
  if (!full.ok() || truncate_to == 0 || full->ids.size() <= truncate_to) return full;
  return LastTokens(*full, truncate_to);
}

}  // namespace tgis::router

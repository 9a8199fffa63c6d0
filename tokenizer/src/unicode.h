// UTF-8 and Unicode property helpers shared by the tokenizer pipeline. The properties follow
// Rust's `char` methods, because that is what HF `tokenizers` uses for the same decisions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tgis::tok {

// Decodes the code point starting at s[i]; returns its length in bytes (1..4). The input is
// assumed valid UTF-8 (checked once at the API boundary with IsValidUtf8).
inline int Utf8Decode(std::string_view s, size_t i, char32_t* cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  if (b0 < 0xE0) {
    *cp = ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3F);
    return 2;
  }
  if (b0 < 0xF0) {
    *cp = ((b0 & 0x0F) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3F) << 6) |
          (static_cast<unsigned char>(s[i + 2]) & 0x3F);
    return 3;
  }
  *cp = ((b0 & 0x07) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3F) << 12) |
        ((static_cast<unsigned char>(s[i + 2]) & 0x3F) << 6) |
        (static_cast<unsigned char>(s[i + 3]) & 0x3F);
  return 4;
}

inline int Utf8Len(char32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// Length of the UTF-8 sequence introduced by lead byte b (1 for continuation bytes).
inline int Utf8SeqLen(unsigned char b) {
  return b < 0x80 ? 1 : b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

void AppendUtf8(char32_t cp, std::string* out);
std::string ToUtf8(char32_t cp);

// Strict validation (no surrogates, no overlongs, <= U+10FFFF).
bool IsValidUtf8(std::string_view s);
// Byte offset of the first invalid sequence, or npos when valid.
size_t FirstInvalidUtf8(std::string_view s);
// Length of the longest prefix of s made of complete, valid UTF-8 sequences, leaving out an
// incomplete (but so far valid) sequence at the very end.
size_t CompleteUtf8Prefix(std::string_view s);
// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
std::string Utf8Lossy(std::string_view bytes);

// Rust char::is_whitespace (Unicode White_Space).
bool IsWhitespace(char32_t c);
// Rust char::is_alphanumeric (Alphabetic or Numeric).
bool IsAlphanumeric(char32_t c);
// Rust char::is_numeric (general categories Nd, Nl, No).
bool IsNumeric(char32_t c);
// HF tokenizers' punctuation test: ASCII punctuation or any P* general category.
bool IsPunctuation(char32_t c);
// Rust regex's \w (Alphabetic, M, Nd, Pc, Join_Control).
bool IsWordChar(char32_t c);
// Unicode general category Cc/Cf/Co/Cn... (used by the Nmt and Bert normalizers).
bool IsControl(char32_t c);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// Normalizes valid UTF-8 text with ICU.
std::string NormalizeUnicode(std::string_view s, NormalForm form);
// True when s is already in the given form (fast path for the common case).
bool IsNormalized(std::string_view s, NormalForm form);

// Extended grapheme cluster boundaries of valid UTF-8 text, as byte offsets (excluding 0,
// including s.size()).
std::vector<size_t> GraphemeBoundaries(std::string_view s);

}  // namespace tgis::tok

#include "grammar/src/utf8.h"

namespace tgis::grammar {
namespace {

int Encode(char32_t c, uint8_t* out) {
  if (c < 0x80) {
    out[0] = static_cast<uint8_t>(c);
    return 1;
  }
  if (c < 0x800) {
    out[0] = static_cast<uint8_t>(0xC0 | (c >> 6));
    out[1] = static_cast<uint8_t>(0x80 | (c & 0x3F));
    return 2;
  }
  if (c < 0x10000) {
    out[0] = static_cast<uint8_t>(0xE0 | (c >> 12));
    out[1] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
    out[2] = static_cast<uint8_t>(0x80 | (c & 0x3F));
    return 3;
  }
  out[0] = static_cast<uint8_t>(0xF0 | (c >> 18));
  out[1] = static_cast<uint8_t>(0x80 | ((c >> 12) & 0x3F));
  out[2] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
  out[3] = static_cast<uint8_t>(0x80 | (c & 0x3F));
  return 4;
}

// [lo, hi] within one encoded length; split until every position's bytes form one range
// whatever the others are (the standard construction, as RE2 and Rust's utf8-ranges do).
void Split(char32_t lo, char32_t hi, std::vector<ByteRangeSeq>* out) {
  if (lo > hi) return;
  for (char32_t max : {char32_t{0x7F}, char32_t{0x7FF}, char32_t{0xFFFF}}) {
    if (lo <= max && max < hi) {
      Split(lo, max, out);
      Split(max + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  for (int i = 1; i < 4; ++i) {
    const char32_t m = (char32_t{1} << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Split(lo, lo | m, out);
        Split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Split(lo, (hi & ~m) - 1, out);
        Split(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  const int n = Encode(lo, a);
  Encode(hi, b);
  ByteRangeSeq seq;
  for (int i = 0; i < n; ++i) seq.emplace_back(a[i], b[i]);
  out->push_back(std::move(seq));
}

}  // namespace

std::optional<std::u32string> DecodeUtf8(std::string_view text) {
  std::u32string out;
  for (size_t i = 0; i < text.size();) {
    const uint8_t b0 = static_cast<uint8_t>(text[i]);
    int n = 0;
    char32_t c = 0, min = 0;
    if (b0 < 0x80) {
      n = 1;
      c = b0;
    } else if ((b0 & 0xE0) == 0xC0) {
      n = 2;
      c = b0 & 0x1F;
      min = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
      n = 3;
      c = b0 & 0x0F;
      min = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
      n = 4;
      c = b0 & 0x07;
      min = 0x10000;
    } else {
      return std::nullopt;
    }
    if (i + n > text.size()) return std::nullopt;
    for (int k = 1; k < n; ++k) {
      const uint8_t b = static_cast<uint8_t>(text[i + k]);
      if ((b & 0xC0) != 0x80) return std::nullopt;
      c = (c << 6) | (b & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return std::nullopt;
    out.push_back(c);
    i += n;
  }
  return out;
}

std::optional<char32_t> ReadHexEscape(std::u32string_view text, size_t* pos, int digits) {
  char32_t value = 0;
  for (int i = 0; i < digits; ++i) {
    if (*pos >= text.size()) return std::nullopt;
    const char32_t h = text[*pos];
    int d = -1;
    if (h >= '0' && h <= '9') d = static_cast<int>(h - '0');
    if (h >= 'a' && h <= 'f') d = static_cast<int>(h - 'a' + 10);
    if (h >= 'A' && h <= 'F') d = static_cast<int>(h - 'A' + 10);
    if (d < 0) return std::nullopt;
    value = value * 16 + static_cast<char32_t>(d);
    ++*pos;
  }
  if (value > 0x10FFFF) return std::nullopt;
  return value;
}

std::vector<ByteRangeSeq> Utf8Sequences(char32_t lo, char32_t hi) {
  std::vector<ByteRangeSeq> out;
  if (hi > 0x10FFFF) hi = 0x10FFFF;
  // Surrogates have no valid encoding.
  if (lo < 0xD800 && hi > 0xDFFF) {
    Split(lo, 0xD7FF, &out);
    Split(0xE000, hi, &out);
  } else if (lo >= 0xD800 && hi <= 0xDFFF) {
    // nothing
  } else {
    if (lo >= 0xD800 && lo <= 0xDFFF) lo = 0xE000;
    if (hi >= 0xD800 && hi <= 0xDFFF) hi = 0xD7FF;
    Split(lo, hi, &out);
  }
  return out;
}

}  // namespace tgis::grammar

#include "tokenizer/src/unicode.h"

#include <unicode/brkiter.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <memory>
#include <mutex>

namespace tgis::tok {

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string ToUtf8(char32_t cp) {
  std::string s;
  AppendUtf8(cp, &s);
  return s;
}

namespace {
// Length of the valid sequence at s[i], or -(length of the maximal invalid subpart) when the
// bytes there do not start a valid sequence. An incomplete sequence cut by the end of the
// input counts as invalid here with its full available length.
int ValidSeqAt(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 == 0xE0) {
    need = 2, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 2;
  } else if (b0 == 0xED) {
    need = 2, hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 3, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 3;
  } else if (b0 == 0xF4) {
    need = 3, hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return -k;
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -k;
  }
  return need + 1;
}
}  // namespace

size_t FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    int n = ValidSeqAt(s, i);
    if (n < 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

bool IsValidUtf8(std::string_view s) { return FirstInvalidUtf8(s) == std::string_view::npos; }

size_t CompleteUtf8Prefix(std::string_view s) {
  // Look back at most 3 bytes for a lead byte whose sequence is cut by the end.
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    if (b >= 0xC0 && Utf8SeqLen(b) > static_cast<int>(back)) {
      // Only hold back when what we have so far is a valid prefix of a sequence.
      int r = ValidSeqAt(s, n - back);
      if (r == -static_cast<int>(back)) return n - back;
    }
    break;
  }
  return n;
}

std::string Utf8Lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out.push_back(s[i++]);
      continue;
    }
    int n = ValidSeqAt(s, i);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += -n;
    }
  }
  return out;
}

bool IsWhitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return u_isUWhiteSpace(static_cast<UChar32>(c));
}

bool IsNumeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool IsAlphanumeric(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
  return u_isUAlphabetic(static_cast<UChar32>(c)) || IsNumeric(c);
}

bool IsPunctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
  }
  return u_ispunct(static_cast<UChar32>(c));
}

bool IsWordChar(char32_t c) {
  if (c < 0x80) {
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || c == '_';
  }
  auto u = static_cast<UChar32>(c);
  if (u_isUAlphabetic(u) || u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL)) return true;
  int32_t mask = U_GET_GC_MASK(u);
  return (mask & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

bool IsControl(char32_t c) {
  int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_PRIVATE_USE_CHAR ||
         t == U_UNASSIGNED || t == U_SURROGATE;
}

namespace {
const icu::Normalizer2* GetNormalizer(NormalForm form) {
  UErrorCode err = U_ZERO_ERROR;
  switch (form) {
    case NormalForm::kNfc:
      return icu::Normalizer2::getNFCInstance(err);
    case NormalForm::kNfd:
      return icu::Normalizer2::getNFDInstance(err);
    case NormalForm::kNfkc:
      return icu::Normalizer2::getNFKCInstance(err);
    case NormalForm::kNfkd:
      return icu::Normalizer2::getNFKDInstance(err);
  }
  return nullptr;
}
}  // namespace

std::string NormalizeUnicode(std::string_view s, NormalForm form) {
  UErrorCode err = U_ZERO_ERROR;
  icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  icu::UnicodeString out = GetNormalizer(form)->normalize(in, err);
  std::string result;
  out.toUTF8String(result);
  return result;
}

bool IsNormalized(std::string_view s, NormalForm form) {
  bool ascii = true;
  for (char ch : s) {
    if (static_cast<unsigned char>(ch) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return true;
  UErrorCode err = U_ZERO_ERROR;
  icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  return GetNormalizer(form)->isNormalized(in, err) && U_SUCCESS(err);
}

std::vector<size_t> GraphemeBoundaries(std::string_view s) {
  std::vector<size_t> out;
  if (s.empty()) return out;
  UErrorCode err = U_ZERO_ERROR;
  thread_local std::unique_ptr<icu::BreakIterator> it(
      icu::BreakIterator::createCharacterInstance(icu::Locale::getRoot(), err));
  icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  it->setText(u);
  // Map UTF-16 boundaries back to UTF-8 byte offsets.
  std::vector<size_t> u16_to_u8(u.length() + 1, 0);
  size_t byte = 0;
  int32_t idx = 0;
  while (idx < u.length()) {
    UChar32 cp = u.char32At(idx);
    int units = U16_LENGTH(cp);
    for (int k = 0; k < units; ++k) u16_to_u8[idx + k] = byte;
    byte += Utf8Len(static_cast<char32_t>(cp));
    idx += units;
  }
  u16_to_u8[u.length()] = byte;
  for (int32_t p = it->next(); p != icu::BreakIterator::DONE; p = it->next()) {
    out.push_back(u16_to_u8[p]);
  }
  return out;
}

}  // namespace tgis::tok

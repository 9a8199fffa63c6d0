// UTF-8 for the automaton compiler: strict decoding, and code point ranges as the byte ranges
// that encode them (so that an automaton over bytes accepts exactly the valid encodings).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tgis::grammar {

// nullopt when `text` is not valid UTF-8 (overlong forms, surrogates, truncation).
std::optional<std::u32string> DecodeUtf8(std::string_view text);

// The code point of `digits` hex digits at text[*pos] (an escape's \xHH, \uHHHH, \UHHHHHHHH),
// advancing *pos past them; nullopt when they are missing or beyond Unicode.
std::optional<char32_t> ReadHexEscape(std::u32string_view text, size_t* pos, int digits);

// A sequence of byte ranges: one byte from each range, in order.
using ByteRangeSeq = std::vector<std::pair<uint8_t, uint8_t>>;

// The encodings of every code point in [lo, hi] (surrogates excluded) as disjoint sequences.
std::vector<ByteRangeSeq> Utf8Sequences(char32_t lo, char32_t hi);

}  // namespace tgis::grammar

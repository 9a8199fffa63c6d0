// GPT-2's reversible byte <-> printable-char table used by byte-level BPE.
#pragma once

#include <array>
#include <string>

namespace tgis::tok {

struct ByteLevelTable {
  std::array<char32_t, 256> byte_to_char;
  std::array<std::string, 256> byte_to_utf8;
  // char -> byte for chars in the table, -1 otherwise (chars are all < 0x144).
  std::array<int, 0x200> char_to_byte;
};

const ByteLevelTable& GetByteLevelTable();

}  // namespace tgis::tok

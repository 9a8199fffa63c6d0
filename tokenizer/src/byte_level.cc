#include "tokenizer/src/byte_level.h"

#include "tokenizer/src/unicode.h"

namespace tgis::tok {

const ByteLevelTable& GetByteLevelTable() {
  static const ByteLevelTable table = [] {
    ByteLevelTable t;
    t.char_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      t.byte_to_char[b] = c;
      t.byte_to_utf8[b] = ToUtf8(c);
      t.char_to_byte[c] = b;
    }
    return t;
  }();
  return table;
}

}  // namespace tgis::tok

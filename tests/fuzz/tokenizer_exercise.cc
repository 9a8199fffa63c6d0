#include "tests/fuzz/tokenizer_exercise.h"

#include <string_view>

namespace tgis::fuzz {

void Exercise(const Tokenizer& tokenizer) {
  static constexpr std::string_view kTexts[] = {
      "Hello, world! It's 3.14159 o'clock.",
      "  leading and   inner   spaces\n\ttabs\r\nlines  ",
      "h\xC3\xA9llo w\xC3\xB6rld \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\xA4\x97",
      "<s> </s> <unk> <pad> <|endoftext|> [CLS] [SEP]",
      "",
  };
  for (std::string_view text : kTexts) {
    for (bool specials : {false, true}) {
      auto encoding = tokenizer.Encode(text, specials);
      if (!encoding.ok()) continue;
      for (bool skip : {false, true}) (void)tokenizer.Decode(encoding->ids, skip);
      IncrementalDecoder stream(tokenizer, /*skip_special_tokens=*/true);
      for (int32_t id : encoding->ids) {
        if (!stream.Next(id).ok()) break;
        (void)tokenizer.IdToToken(id);
        (void)tokenizer.IsSpecial(id);
        (void)tokenizer.DecodesAsByteGroup(id);
        (void)tokenizer.TokenBytes(id);
      }
      (void)stream.Flush();
    }
  }
  // Ids the tokenizer does not have are skipped when decoding, not read out of bounds.
  const int32_t edge[] = {-1, 0, static_cast<int32_t>(tokenizer.VocabSize()),
                          static_cast<int32_t>(tokenizer.VocabSize()) - 1, 2147483647};
  (void)tokenizer.Decode(edge, false);
  for (int32_t id : edge) (void)tokenizer.IdToToken(id);
}

}  // namespace tgis::fuzz

// Prompt encoding and truncation (router/input_encoding.h).
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "router/input_encoding.h"

namespace tgis::router {
namespace {

std::unique_ptr<Tokenizer> Load(const std::string& dir) {
  auto t = Tokenizer::FromDirectory(std::string(TGIS_FIXTURES_DIR) + "/" + dir);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

constexpr char kText[] = "The quick brown fox jumps over the lazy dog.";

TEST(RouterInputEncoding, NoTruncation) {
  auto t = Load("models/llama");
  ASSERT_TRUE(t);
  Encoding full = *t->Encode(kText, true);
  for (uint32_t n : {0u, static_cast<uint32_t>(full.ids.size()), 1000u}) {
    Encoding e = *EncodeInput(*t, kText, n);
    EXPECT_EQ(e.ids, full.ids);
    EXPECT_EQ(e.offsets, full.offsets);
  }
}

TEST(RouterInputEncoding, TruncationKeepsTheLastTokensAndTheBos) {
  auto t = Load("models/llama");
  ASSERT_TRUE(t);
  Encoding full = *t->Encode(kText, true);
  ASSERT_EQ(full.ids[0], *t->special_ids().bos);
  Encoding e = *EncodeInput(*t, kText, 5);
  ASSERT_EQ(e.ids.size(), 5u);
  EXPECT_EQ(e.ids[0], full.ids[0]);
  EXPECT_EQ(std::vector<int32_t>(e.ids.begin() + 1, e.ids.end()),
            std::vector<int32_t>(full.ids.end() - 4, full.ids.end()));
  EXPECT_EQ(e.tokens.size(), 5u);
  EXPECT_EQ(e.offsets.back(), full.offsets.back());
  // Only the BOS is left at 1, as in TGIS.
  e = *EncodeInput(*t, kText, 1);
  EXPECT_EQ(e.ids, std::vector<int32_t>{full.ids[0]});
}

TEST(RouterInputEncoding, TruncationWithoutSpecialTokens) {
  auto t = Load("models/gpt2");
  ASSERT_TRUE(t);
  Encoding full = *t->Encode(kText, true);
  Encoding e = *EncodeInput(*t, kText, 3);
  EXPECT_EQ(e.ids, std::vector<int32_t>(full.ids.end() - 3, full.ids.end()));
}

}  // namespace
// A long input's prefix has no more tokens than the whole (its tokens are the first of the
// whole's), in every tokenizer family, so refusing from it is sound.
TEST(RouterInputEncoding, LongInputIsJudgedFromAPrefixThatUndercountsIt) {
  std::string text;
  for (int i = 0; text.size() < (200u << 10); ++i) {
    text += i % 7 == 0 ? "Gr\xC3\xBC\xC3\x9F"
                         "e  aus K\xC3\xB6ln,\n"
                       : "the quick brown fox 1234 ";
  }
  for (const char* dir :
       {"models/llama", "tokenizers/gpt2", "tokenizers/t5", "tokenizers/bloom", "tokenizers/llama3",
        "tokenizers/unigram_hf", "tokenizers/qwen2", "tokenizers/gpt_oss"}) {
    SCOPED_TRACE(dir);
    auto t = Load(dir);
    ASSERT_TRUE(t);
    const size_t full = t->Encode(text, true)->ids.size();
    std::optional<size_t> at_least = TokensOfLongPrefix(*t, text, 1000);
    ASSERT_TRUE(at_least.has_value());
    EXPECT_GE(*at_least, 1000u);
    EXPECT_LE(*at_least, full);
    // A limit the text may fit in bytes is left to the whole text.
    EXPECT_FALSE(TokensOfLongPrefix(*t, text, text.size() / 32).has_value());
  }
}

TEST(RouterInputEncoding, ShortOrUnbrokenInputsAreLeftToTheWholeText) {
  auto t = Load("models/llama");
  ASSERT_TRUE(t);
  EXPECT_FALSE(TokensOfLongPrefix(*t, std::string(60 << 10, 'a') + " b", 10).has_value());
  // No whitespace to cut at: one word, which may be a single token.
  EXPECT_FALSE(TokensOfLongPrefix(*t, std::string(300 << 10, 'a'), 10).has_value());
}

}  // namespace tgis::router

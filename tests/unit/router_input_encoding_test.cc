// Prompt encoding and truncation (router/input_encoding.h).
#include <gtest/gtest.h>

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
}  // namespace tgis::router

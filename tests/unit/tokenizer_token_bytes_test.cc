// Tokenizer::TokenBytes against HF's own decode (tests/fixtures/make_guided_fixtures.py): the
// bytes of a text's tokens, concatenated, are what `tokenizers` / `sentencepiece` decode in the
// middle of a text, for every tokenizer fixture.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace {

TEST(TokenBytes, ConcatenatedAreWhatHfDecodes) {
  tgis::EnableSentencePieceModels();
  const std::string root = std::string(TGIS_FIXTURES_DIR);
  std::ifstream in(root + "/guided/token_bytes.json");
  std::stringstream buf;
  buf << in.rdbuf();
  const auto cases = nlohmann::json::parse(buf.str());
  ASSERT_GE(cases.size(), 10u);
  size_t checked = 0;
  for (const auto& [name, rows] : cases.items()) {
    auto tok = tgis::Tokenizer::FromDirectory(root + "/tokenizers/" + name);
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.status();
    for (const auto& row : rows) {
      const std::vector<int32_t> ids = row[0].get<std::vector<int32_t>>();
      std::string got;
      bool special = false;  // a special token's text (<unk>): guided decoding never picks one
      for (size_t i = 1; i < ids.size(); ++i) {
        std::optional<std::string> bytes = (*tok)->TokenBytes(ids[i]);
        special = special || (*tok)->IsSpecial(ids[i]);
        ASSERT_TRUE(bytes.has_value() || (*tok)->IsSpecial(ids[i])) << name << " id " << ids[i];
        got += bytes.value_or("");
      }
      if (!special) {
        EXPECT_EQ(got, row[2].get<std::string>()) << name;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 500u);
}

TEST(TokenBytes, SpecialTokensAndUnknownIdsHaveNone) {
  tgis::EnableSentencePieceModels();
  for (const char* name : {"llama2", "llama_spm", "gpt2", "llama3", "gpt_oss"}) {
    auto tok =
        tgis::Tokenizer::FromDirectory(std::string(TGIS_FIXTURES_DIR) + "/tokenizers/" + name);
    ASSERT_TRUE(tok.ok()) << tok.status();
    const auto& special = (*tok)->special_ids();
    for (const auto& id : {special.bos, special.eos}) {
      if (id.has_value()) {
        EXPECT_FALSE((*tok)->TokenBytes(*id).has_value()) << name << " " << *id;
      }
    }
    EXPECT_FALSE((*tok)->TokenBytes(-1).has_value());
    EXPECT_FALSE((*tok)->TokenBytes(static_cast<int32_t>((*tok)->VocabSize()) + 5).has_value());
  }
}

TEST(TokenBytes, ByteTokensAreRawBytes) {
  tgis::EnableSentencePieceModels();
  // Llama's byte-fallback tokens: <0xE6> is the byte 0xE6, not U+FFFD.
  for (const char* name : {"llama2", "llama_spm"}) {
    auto tok =
        tgis::Tokenizer::FromDirectory(std::string(TGIS_FIXTURES_DIR) + "/tokenizers/" + name);
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::optional<int32_t> id = (*tok)->TokenToId("<0xE6>");
    ASSERT_TRUE(id.has_value()) << name;
    EXPECT_EQ((*tok)->TokenBytes(*id), std::string("\xE6")) << name;
  }
}

}  // namespace

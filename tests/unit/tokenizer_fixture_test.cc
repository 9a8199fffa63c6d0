// Golden comparisons against HF tokenizers / sentencepiece: the fixtures under
// tests/fixtures/tokenizers/<family>/golden.json were written by
// tests/fixtures/make_tokenizer_fixtures.py with the Python reference libraries.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::vector<std::string> Families() {
  std::vector<std::string> out;
  const fs::path root = fs::path(TGIS_FIXTURES_DIR) / "tokenizers";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.is_directory() && fs::exists(e.path() / "golden.json")) {
      out.push_back(e.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

Json ReadJson(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream buf;
  buf << in.rdbuf();
  return Json::parse(buf.str());
}

class FixtureTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tgis::EnableSentencePieceModels();
    dir_ = fs::path(TGIS_FIXTURES_DIR) / "tokenizers" / GetParam();
    auto tok = tgis::Tokenizer::FromDirectory(dir_.string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
    golden_ = ReadJson(dir_ / "golden.json");
    ASSERT_TRUE(golden_.is_array());
    ASSERT_FALSE(golden_.empty());
  }
  fs::path dir_;
  std::unique_ptr<tgis::Tokenizer> tok_;
  Json golden_;
};

TEST_P(FixtureTest, EncodeMatchesReference) {
  for (const Json& g : golden_) {
    const std::string text = g["text"];
    auto enc = tok_->Encode(text, true);
    ASSERT_TRUE(enc.ok()) << enc.status();
    EXPECT_EQ(enc->ids, g["ids"].get<std::vector<int32_t>>()) << "text: " << Json(text).dump();
    if (g.contains("tokens")) {
      EXPECT_EQ(enc->tokens, g["tokens"].get<std::vector<std::string>>())
          << "text: " << Json(text).dump();
    }
    std::vector<std::vector<uint32_t>> offsets;
    for (const auto& o : enc->offsets) offsets.push_back({o.start, o.end});
    EXPECT_EQ(offsets, g["offsets"].get<std::vector<std::vector<uint32_t>>>())
        << "text: " << Json(text).dump();
    auto plain = tok_->Encode(text, false);
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ(plain->ids, g["ids_no_special"].get<std::vector<int32_t>>())
        << "text: " << Json(text).dump();
  }
}

TEST_P(FixtureTest, DecodeMatchesReference) {
  for (const Json& g : golden_) {
    const auto ids = g["ids"].get<std::vector<int32_t>>();
    auto text = tok_->Decode(ids, false);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(*text, g["decoded"].get<std::string>()) << "text: " << g["text"].dump();
    auto skipped = tok_->Decode(ids, true);
    ASSERT_TRUE(skipped.ok());
    EXPECT_EQ(*skipped, g["decoded_skip"].get<std::string>()) << "text: " << g["text"].dump();
  }
}

TEST_P(FixtureTest, StreamingConcatenationEqualsDecode) {
  for (const Json& g : golden_) {
    const auto ids = g["ids"].get<std::vector<int32_t>>();
    for (bool skip : {false, true}) {
      tgis::IncrementalDecoder dec(*tok_, skip);
      std::string all;
      for (int32_t id : ids) {
        auto piece = dec.Next(id);
        ASSERT_TRUE(piece.ok());
        EXPECT_EQ(piece->find("\xEF\xBF\xBD"), std::string::npos)
            << "a piece carried U+FFFD for " << g["text"].dump();
        all += *piece;
      }
      auto rest = dec.Flush();
      ASSERT_TRUE(rest.ok());
      all += *rest;
      EXPECT_EQ(all, g[skip ? "decoded_skip" : "decoded"].get<std::string>())
          << "text: " << g["text"].dump();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FixtureTest, ::testing::ValuesIn(Families()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FixtureTest);

}  // namespace

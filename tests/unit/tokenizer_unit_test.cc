// Behaviour that needs no reference library: errors, bad input, the streaming decoder's
// handling of split UTF-8, and the UTF-8 helpers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tokenizer/sentencepiece.h"
#include "tokenizer/src/hf_tokenizer.h"
#include "tokenizer/src/unicode.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("tgis_tok_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  void Write(const std::string& name, const std::string& content) const {
    std::ofstream(path_ / name, std::ios::binary) << content;
  }
  std::string str() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

// A tiny byte-level BPE: bytes of "é" (C3 A9) are separate tokens, merged by one rule.
std::string ByteLevelJson(const std::string& model_extra = "") {
  return R"({
    "version": "1.0",
    "added_tokens": [{"id": 6, "content": "<|eos|>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                      "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null,
              "continuing_subword_prefix": null, "end_of_word_suffix": null,
              "fuse_unk": false, "byte_fallback": false)" +
         model_extra + R"(,
              "vocab": {"a": 0, "b": 1, "Ã": 2, "©": 3, "Ġ": 4, "Ã©": 5},
              "merges": ["Ã ©"]}
  })";
}

TEST(TokenizerLoad, MissingDirectoryNamesIt) {
  auto t = tgis::Tokenizer::FromDirectory("/nonexistent/model");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("/nonexistent/model"), std::string::npos);
}

TEST(TokenizerLoad, EmptyDirectorySaysWhatIsMissing) {
  TempDir d;
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tokenizer.json"), std::string::npos);
}

TEST(TokenizerLoad, TruncatedJsonNamesTheFile) {
  TempDir d;
  std::string json = ByteLevelJson();
  d.Write("tokenizer.json", json.substr(0, json.size() / 2));
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tokenizer.json"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("invalid JSON"), std::string::npos) << t.status();
}

// Found by the model_config fuzz target in config.json, and the same in both tokenizer files:
// a number beyond double (1e500) is nlohmann's out_of_range, not a parse_error, and ended the
// process uncaught.
TEST(TokenizerLoad, ANumberBeyondDoubleIsAnErrorNamingTheFile) {
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
    TempDir d;
    d.Write("tokenizer.json", ByteLevelJson());
    d.Write(file, R"({"model_max_length": 1e500})");
    auto t = tgis::Tokenizer::FromDirectory(d.str());
    ASSERT_FALSE(t.ok()) << file;
    EXPECT_NE(t.status().message().find(std::string(file) + ": invalid JSON"), std::string::npos)
        << t.status();
  }
}

TEST(TokenizerLoad, WrongFieldTypeNamesTheField) {
  TempDir d;
  std::string json = ByteLevelJson();
  json.replace(json.find(R"("merges": ["Ã ©"])"), std::string(R"("merges": ["Ã ©"])").size(),
               R"("merges": 7)");
  d.Write("tokenizer.json", json);
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tokenizer.json: model.merges"), std::string::npos)
      << t.status();
}

// Found by fuzzing: an id beyond int32 wrapped to a negative index (undefined behaviour), and a
// huge one would size the vocabulary array by it. Every token id is bounded and named.
TEST(TokenizerLoad, TokenIdsBeyondTheLimitNameTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("Ã©": 5})", R"("Ã©": 2147483653})"},
      {R"("Ã©": 5})", R"("Ã©": 18446744073709551615})"},
      {R"("Ã©": 5})", R"("Ã©": 16777216})"},
      {R"({"id": 6,)", R"({"id": 4294967302,)"},
  };
  for (const auto& [from, to] : cases) {
    TempDir d;
    std::string json = ByteLevelJson();
    json.replace(json.find(from), from.size(), to);
    d.Write("tokenizer.json", json);
    auto t = tgis::Tokenizer::FromDirectory(d.str());
    ASSERT_FALSE(t.ok()) << to;
    EXPECT_NE(t.status().message().find("is not in [0, 16777216)"), std::string::npos)
        << t.status();
    EXPECT_NE(t.status().message().find(to.find("id") != std::string::npos ? "added_tokens[0].id"
                                                                           : "model.vocab"),
              std::string::npos)
        << t.status();
  }
}

// Found by fuzzing: a template's special token without "ids" was read through nlohmann's
// const operator[] (undefined behaviour: a read of freed memory under ASan).
TEST(TokenizerLoad, TemplateSpecialTokenWithoutIdsNamesTheField) {
  TempDir d;
  std::string json = ByteLevelJson();
  json.replace(json.find(R"("post_processor": null)"),
               std::string(R"("post_processor": null)").size(),
               R"("post_processor": {"type": "TemplateProcessing",
                    "single": [{"Sequence": {"id": "A", "type_id": 0}},
                               {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}],
                    "pair": [], "special_tokens": {"<|eos|>": {"id": "<|eos|>",
                                                               "tokens": ["<|eos|>"]}}})");
  d.Write("tokenizer.json", json);
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(R"(special_tokens["<|eos|>"].ids: missing field)"),
            std::string::npos)
      << t.status();
}

// Fuzz finding (UBSan): a float count such as 2e32 was converted to an integer.
TEST(TokenizerLoad, CountFieldsThatAreNotNonNegativeIntegersNameTheField) {
  const std::pair<std::string, std::string> cases[] = {
      {R"("decoder": {"type": "Strip", "content": " ", "start": 2e32, "stop": 0})",
       "decoder.start: 2e+32 is not an integer"},
      {R"("decoder": {"type": "Strip", "content": " ", "start": 1, "stop": -1})",
       "decoder.stop: -1 is not an integer"},
      {R"("normalizer": {"type": "Precompiled", "precompiled_charsmap": [1, 2.5]})",
       "precompiled_charsmap: 2.5 is not a byte"},
  };
  for (const auto& [component, message] : cases) {
    TempDir d;
    std::string json = ByteLevelJson();
    const std::string key = component.substr(0, component.find(':'));
    const size_t at = json.find(key + ": ");
    ASSERT_NE(at, std::string::npos) << key;
    // Replace the component's whole value: up to the next top-level key.
    const size_t end = json.find(",\n    \"", at);
    json.replace(at, end - at, component);
    d.Write("tokenizer.json", json);
    auto t = tgis::Tokenizer::FromDirectory(d.str());
    ASSERT_FALSE(t.ok()) << component;
    EXPECT_NE(t.status().message().find(message), std::string::npos) << t.status();
  }
}

TEST(TokenizerLoad, UnsupportedComponentIsAnErrorNamingIt) {
  TempDir d;
  std::string json = ByteLevelJson();
  json.replace(json.find(R"("normalizer": null)"), std::string(R"("normalizer": null)").size(),
               R"("normalizer": {"type": "Sequence", "normalizers": [{"type": "Wobble"}]})");
  d.Write("tokenizer.json", json);
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("normalizer.normalizers[0]"), std::string::npos)
      << t.status();
  EXPECT_NE(t.status().message().find("Wobble"), std::string::npos) << t.status();
}

TEST(TokenizerLoad, MergeWithUnknownTokenNamesTheMerge) {
  TempDir d;
  std::string json = ByteLevelJson();
  json.replace(json.find(R"(["Ã ©"])"), std::string(R"(["Ã ©"])").size(), R"(["Ã ©", "a z"])");
  d.Write("tokenizer.json", json);
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model.merges[1]"), std::string::npos) << t.status();
}

TEST(TokenizerLoad, SentencePieceModelNeedsTheBackend) {
  TempDir d;
  d.Write("spiece.model", "whatever");
  tgis::tok::SentencePieceLoader() = nullptr;
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("spiece.model"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("tokenizer.json"), std::string::npos) << t.status();
}

TEST(TokenizerLoad, CorruptSentencePieceModelNamesTheFile) {
  tgis::EnableSentencePieceModels();
  TempDir d;
  d.Write("spiece.model", "this is not a protobuf");
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("spiece.model"), std::string::npos) << t.status();
}

TEST(TokenizerEncode, InvalidUtf8IsAnErrorNotACrash) {
  TempDir d;
  d.Write("tokenizer.json", ByteLevelJson());
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok()) << t.status();
  for (std::string bad : {std::string("a\xC3"), std::string("\xFF"), std::string("\xED\xA0\x80"),
                          std::string("\xC0\xAF")}) {
    auto enc = (*t)->Encode(bad, true);
    EXPECT_FALSE(enc.ok());
    EXPECT_EQ(enc.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(TokenizerEncode, EmptyStringGivesNoTokens) {
  TempDir d;
  d.Write("tokenizer.json", ByteLevelJson());
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok());
  auto enc = (*t)->Encode("", true);
  ASSERT_TRUE(enc.ok());
  EXPECT_TRUE(enc->ids.empty());
}

TEST(TokenizerEncode, ByteLevelMergeAndSpecialToken) {
  TempDir d;
  d.Write("tokenizer.json", ByteLevelJson());
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok());
  auto enc = (*t)->Encode("ab é<|eos|>", true);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(enc->ids, (std::vector<int32_t>{0, 1, 4, 5, 6}));
  EXPECT_EQ(enc->offsets.back(), (tgis::TokenOffset{5, 12}));
  EXPECT_EQ(enc->offsets[3], (tgis::TokenOffset{3, 5}));
}

// An added token whose content the model vocabulary already has takes the model's id, not the
// id written in the file (HF tokenizers 0.21.1 encodes "ba" as [1, 0] and decodes [9, 0, 1] as
// "ab" for this file).
TEST(TokenizerEncode, AddedTokenInModelVocabKeepsTheModelId) {
  TempDir d;
  std::string json = ByteLevelJson();
  json.replace(json.find(R"({"id": 6, "content": "<|eos|>")"),
               std::string(R"({"id": 6, "content": "<|eos|>")").size(),
               R"({"id": 9, "content": "a")");
  json.replace(json.find(R"("special": true})"), std::string(R"("special": true})").size(),
               R"("special": false})");
  d.Write("tokenizer.json", json);
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok()) << t.status();
  auto enc = (*t)->Encode("ba", true);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(enc->ids, (std::vector<int32_t>{1, 0}));
  std::vector<int32_t> ids = {9, 0, 1};
  EXPECT_EQ(*(*t)->Decode(ids, false), "ab");
}

TEST(IncrementalDecoder, HoldsBackSplitCodePoint) {
  TempDir d;
  d.Write("tokenizer.json", ByteLevelJson());
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok());
  tgis::IncrementalDecoder dec(**t, false);
  EXPECT_EQ(*dec.Next(0), "a");
  EXPECT_EQ(*dec.Next(2), "");  // first byte of "é": held back
  EXPECT_EQ(*dec.Next(3), "é");
  EXPECT_EQ(*dec.Next(4), " ");
  EXPECT_EQ(*dec.Next(2), "");
  // The sequence ends inside a code point: the flush gives what decode gives.
  EXPECT_EQ(*dec.Flush(), "\xEF\xBF\xBD");
}

TEST(IncrementalDecoder, ContextIsNotRepeated) {
  TempDir d;
  d.Write("tokenizer.json", ByteLevelJson());
  auto t = tgis::Tokenizer::FromDirectory(d.str());
  ASSERT_TRUE(t.ok());
  std::vector<int32_t> prompt = {0, 1};
  tgis::IncrementalDecoder dec(**t, true, prompt);
  EXPECT_EQ(*dec.Next(4), " ");
  EXPECT_EQ(*dec.Next(5), "é");
  EXPECT_EQ(*dec.Next(6), "");  // special token skipped
  EXPECT_EQ(*dec.Flush(), "");
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(tgis::tok::Utf8Lossy("a\xE4\xB8"), "a\xEF\xBF\xBD");
  EXPECT_EQ(tgis::tok::Utf8Lossy("\xE4\xB8x\xFF"), "\xEF\xBF\xBDx\xEF\xBF\xBD");
  EXPECT_EQ(tgis::tok::Utf8Lossy("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(tgis::tok::Utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Utf8, CompletePrefixStopsBeforeCutSequence) {
  EXPECT_EQ(tgis::tok::CompleteUtf8Prefix("ab\xE4\xB8"), 2u);
  EXPECT_EQ(tgis::tok::CompleteUtf8Prefix("ab\xE4\xB8\xAD"), 5u);
  EXPECT_EQ(tgis::tok::CompleteUtf8Prefix("ab"), 2u);
}

}  // namespace

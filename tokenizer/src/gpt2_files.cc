#include "tokenizer/src/gpt2_files.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tgis::tok {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

absl::StatusOr<std::string> ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), ": cannot open"));
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// A special token as the slow tokenizer holds it: a string, or an AddedToken dict
// ({"content", "lstrip", "rstrip", "single_word", "normalized", ...}).
struct Token {
  std::string content;
  bool lstrip = false, rstrip = false, single_word = false, normalized = false;
};

std::optional<Token> TokenFrom(const Json& v) {
  Token t;
  if (v.is_string()) {
    t.content = v.get<std::string>();
    return t;  // a special token given by name: not normalized, no stripping
  }
  if (!v.is_object() || !v.contains("content") || !v["content"].is_string()) return std::nullopt;
  t.content = v["content"].get<std::string>();
  auto flag = [&](const char* k, bool fallback) {
    return v.contains(k) && v[k].is_boolean() ? v[k].get<bool>() : fallback;
  };
  t.lstrip = flag("lstrip", false);
  t.rstrip = flag("rstrip", false);
  t.single_word = flag("single_word", false);
  t.normalized = flag("normalized", false);
  return t;
}

Json AddedTokenJson(int64_t id, const Token& t, bool special) {
  return Json{{"id", id},           {"content", t.content}, {"single_word", t.single_word},
              {"lstrip", t.lstrip}, {"rstrip", t.rstrip},   {"normalized", t.normalized},
              {"special", special}};
}

}  // namespace

bool HasGpt2Files(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / "vocab.json", ec) && fs::exists(dir / "merges.txt", ec);
}

absl::StatusOr<Json> Gpt2FilesToTokenizerJson(const fs::path& dir, const Json& config,
                                              const Json& special_map) {
  const fs::path vocab_file = dir / "vocab.json", merges_file = dir / "merges.txt";
  if (config.contains("tokenizer_class") && config["tokenizer_class"].is_string()) {
    const std::string cls = config["tokenizer_class"].get<std::string>();
    if (cls != "GPT2Tokenizer" && cls != "GPT2TokenizerFast") {
      return absl::UnimplementedError(absl::StrCat(
          (dir / "tokenizer_config.json").string(), ": tokenizer_class ", cls,
          " has no tokenizer.json here, and only GPT2Tokenizer's vocab.json + merges.txt are "
          "converted; save the tokenizer with transformers (tokenizer.json) first"));
    }
  }
  auto vocab_text = ReadAll(vocab_file);
  if (!vocab_text.ok()) return vocab_text.status();
  Json vocab = Json::parse(*vocab_text, nullptr, false);
  if (!vocab.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(vocab_file.string(), ": not a JSON object"));
  }
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat(vocab_file.string(), ": id of \"", token, "\" is not an integer"));
    }
  }
  auto merges_text = ReadAll(merges_file);
  if (!merges_text.ok()) return merges_text.status();
  // As GPT2Tokenizer reads it: the first line is the "#version" header and the last is what
  // follows the final newline, both dropped.
  std::vector<std::string> lines = absl::StrSplit(*merges_text, '\n');
  Json merges = Json::array();
  for (size_t i = 1; i + 1 < lines.size(); ++i) {
    std::vector<std::string> pair = absl::StrSplit(lines[i], ' ', absl::SkipEmpty());
    if (pair.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(merges_file.string(), ": line ", i + 1,
                                                     " is not two tokens: \"", lines[i], "\""));
    }
    merges.push_back(Json::array({pair[0], pair[1]}));
  }
  auto flag = [&](const char* key) {
    return config.contains(key) && config[key].is_boolean() && config[key].get<bool>();
  };
  auto special = [&](const char* key) -> std::optional<Token> {
    if (config.contains(key) && !config[key].is_null()) return TokenFrom(config[key]);
    if (special_map.contains(key) && !special_map[key].is_null()) {
      return TokenFrom(special_map[key]);
    }
    return std::nullopt;
  };
  const int64_t vocab_size = static_cast<int64_t>(vocab.size());
  // Added tokens: those transformers saved with their ids, then the named special tokens (ids
  // from the vocabulary, or the next free ones), in that order.
  Json added = Json::array();
  std::set<std::string> seen;
  int64_t next_id = vocab_size;
  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object()) {
    std::vector<std::pair<int64_t, Json>> by_id;
    for (const auto& [id, v] : config["added_tokens_decoder"].items()) {
      by_id.emplace_back(std::stoll(id), v);
    }
    std::sort(by_id.begin(), by_id.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [id, v] : by_id) {
      auto t = TokenFrom(v);
      if (!t) continue;
      const bool is_special =
          v.contains("special") && v["special"].is_boolean() ? v["special"].get<bool>() : false;
      added.push_back(AddedTokenJson(id, *t, is_special));
      seen.insert(t->content);
      next_id = std::max(next_id, id + 1);
    }
  }
  std::vector<Token> specials;
  std::map<std::string, int64_t> special_ids;  // from added_tokens.json
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (auto t = special(key)) specials.push_back(*t);
  }
  const Json& extra = config.contains("additional_special_tokens")
                          ? config["additional_special_tokens"]
                          : special_map.value("additional_special_tokens", Json::array());
  if (extra.is_array()) {
    for (const Json& v : extra) {
      if (auto t = TokenFrom(v)) specials.push_back(*t);
    }
  }
  // added_tokens.json (the slow tokenizer's tokens beyond the vocabulary, {content: id}):
  // special when named above, else plain added tokens.
  if (std::error_code ec; fs::exists(dir / "added_tokens.json", ec)) {
    auto text = ReadAll(dir / "added_tokens.json");
    if (!text.ok()) return text.status();
    const Json file = Json::parse(*text, nullptr, false);
    if (!file.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat((dir / "added_tokens.json").string(), ": not a JSON object"));
    }
    std::vector<std::pair<int64_t, std::string>> by_id;
    for (const auto& [content, id] : file.items()) {
      if (!id.is_number_unsigned()) {
        return absl::InvalidArgumentError(absl::StrCat(
            (dir / "added_tokens.json").string(), ": id of \"", content, "\" is not an integer"));
      }
      by_id.emplace_back(id.get<int64_t>(), content);
    }
    std::sort(by_id.begin(), by_id.end());
    for (const auto& entry : by_id) {
      const int64_t id = entry.first;
      const std::string& content = entry.second;
      if (seen.count(content)) continue;
      const bool is_special = std::any_of(specials.begin(), specials.end(),
                                          [&](const Token& t) { return t.content == content; });
      Token t;
      t.content = content;
      t.normalized = !is_special;
      if (!is_special) {
        added.push_back(AddedTokenJson(id, t, false));
        seen.insert(content);
        next_id = std::max(next_id, id + 1);
      } else {
        // Named special tokens come below, with their flags; the id is this one.
        special_ids[content] = id;
      }
    }
  }
  for (const Token& t : specials) {
    if (!seen.insert(t.content).second) continue;
    int64_t id;
    if (vocab.contains(t.content)) {
      id = vocab[t.content].get<int64_t>();
    } else if (auto it = special_ids.find(t.content); it != special_ids.end()) {
      id = it->second;
    } else {
      id = next_id++;
    }
    added.push_back(AddedTokenJson(id, t, true));
  }
  const bool add_prefix_space = flag("add_prefix_space");
  Json post;
  if (flag("add_bos_token")) {
    auto bos = special("bos_token");
    if (!bos) {
      return absl::InvalidArgumentError(absl::StrCat((dir / "tokenizer_config.json").string(),
                                                     ": add_bos_token is set but no bos_token"));
    }
    int64_t bos_id = -1;
    for (const Json& a : added) {
      if (a["content"] == bos->content) bos_id = a["id"].get<int64_t>();
    }
    post = {{"type", "TemplateProcessing"},
            {"single", Json::array({{{"SpecialToken", {{"id", bos->content}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", Json::array({{{"SpecialToken", {{"id", bos->content}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
            {"special_tokens",
             {{bos->content,
               {{"id", bos->content},
                {"ids", Json::array({bos_id})},
                {"tokens", Json::array({bos->content})}}}}}};
  } else {
    post = {{"type", "ByteLevel"},
            {"add_prefix_space", true},
            {"trim_offsets", false},
            {"use_regex", true}};
  }
  return Json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer",
               {{"type", "ByteLevel"},
                {"add_prefix_space", add_prefix_space},
                {"trim_offsets", true},
                {"use_regex", true}}},
              {"post_processor", post},
              {"decoder",
               {{"type", "ByteLevel"},
                {"add_prefix_space", true},
                {"trim_offsets", true},
                {"use_regex", true}}},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges}}}};
}

}  // namespace tgis::tok

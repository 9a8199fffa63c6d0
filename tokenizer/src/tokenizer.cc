// Loading a model folder, and the incremental decoder.
#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/gpt2_files.h"
#include "tokenizer/src/hf_tokenizer.h"
#include "tokenizer/src/unicode.h"

namespace tgis {

namespace tok {
SpLoader& SentencePieceLoader() {
  static SpLoader loader = nullptr;
  return loader;
}
}  // namespace tok

bool IsValidUtf8(std::string_view text) { return tok::IsValidUtf8(text); }

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// Reads an optional JSON file; a missing file is an empty object, a broken one an error.
absl::StatusOr<Json> ReadOptionalJson(const fs::path& p) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return Json::object();
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), ": cannot open"));
  std::stringstream buf;
  buf << in.rdbuf();
  try {
    Json j = Json::parse(buf.str());
    if (!j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(p.string(), ": expected a JSON object"));
    }
    return j;
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for a number like 1e500
    return absl::InvalidArgumentError(absl::StrCat(p.string(), ": invalid JSON: ", e.what()));
  }
}

// "bos_token": "<s>" or {"content": "<s>", ...}.
std::optional<std::string> TokenContent(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDirectory(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  auto config = ReadOptionalJson(root / "tokenizer_config.json");
  if (!config.ok()) return config.status();
  auto special_map = ReadOptionalJson(root / "special_tokens_map.json");
  if (!special_map.ok()) return special_map.status();
  auto flag = [&](const char* key) -> std::optional<bool> {
    auto it = config->find(key);
    if (it == config->end() || !it->is_boolean()) return std::nullopt;
    return it->get<bool>();
  };

  std::unique_ptr<Tokenizer> tok;
  if (fs::exists(root / "tokenizer.json", ec)) {
    auto t = tok::LoadHfTokenizer((root / "tokenizer.json").string());
    if (!t.ok()) return t.status();
    tok = std::move(*t);
  } else if (tok::HasGpt2Files(root)) {
    auto json = tok::Gpt2FilesToTokenizerJson(root, *config, *special_map);
    if (!json.ok()) return json.status();
    auto t = tok::LoadHfTokenizerJson(*json, (root / "vocab.json").string() + " + merges.txt");
    if (!t.ok()) return t.status();
    tok = std::move(*t);
  } else {
    fs::path sp;
    for (const char* name : {"tokenizer.model", "spiece.model"}) {
      if (fs::exists(root / name, ec)) {
        sp = root / name;
        break;
      }
    }
    if (sp.empty()) {
      return absl::NotFoundError(absl::StrCat(
          dir,
          ": no tokenizer.json, vocab.json + merges.txt, tokenizer.model or spiece.model in "
          "this directory"));
    }
    if (tok::SentencePieceLoader() == nullptr) {
      return absl::UnimplementedError(
          absl::StrCat(sp.string(),
                       ": this program reads tokenizer.json only (SentencePiece .model files are "
                       "not linked in); convert the tokenizer to tokenizer.json"));
    }
    auto t = tok::SentencePieceLoader()(sp.string(), flag("add_bos_token").value_or(false),
                                        flag("add_eos_token").value_or(false));
    if (!t.ok()) return t.status();
    tok = std::move(*t);
  }

  // Named special tokens: tokenizer_config.json first, then special_tokens_map.json; the
  // model's own ids (SentencePiece) remain where neither names one.
  auto resolve = [&](const char* key, std::optional<int32_t>* slot) -> absl::Status {
    std::optional<std::string> content = TokenContent(*config, key);
    if (!content) content = TokenContent(*special_map, key);
    if (!content) return absl::OkStatus();
    if (auto id = tok->TokenToId(*content)) {
      *slot = *id;
    }
    return absl::OkStatus();
  };
  SpecialTokenIds& s = tok->special_;
  for (auto [key, slot] : {std::pair{"bos_token", &s.bos}, std::pair{"eos_token", &s.eos},
                           std::pair{"pad_token", &s.pad}, std::pair{"unk_token", &s.unk}}) {
    if (auto st = resolve(key, slot); !st.ok()) return st;
  }
  return tok;
}

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens,
                                       std::span<const int32_t> context)
    : tokenizer_(tokenizer),
      skip_special_(skip_special_tokens),
      ids_(context.begin(), context.end()),
      prefix_offset_(0),
      read_offset_(context.size()) {}

absl::StatusOr<std::string> IncrementalDecoder::Next(int32_t id) {
  ids_.push_back(id);
  // Byte-fallback tokens decode as a group (an invalid group turns every byte into U+FFFD),
  // so nothing is final while the sequence ends inside such a group.
  if (tokenizer_.DecodesAsByteGroup(id)) return std::string();
  return Step(/*final=*/false);
}

absl::StatusOr<std::string> IncrementalDecoder::Flush() { return Step(/*final=*/true); }

absl::StatusOr<std::string> IncrementalDecoder::Step(bool final) {
  if (read_offset_ >= ids_.size()) return std::string();
  std::span<const int32_t> all(ids_);
  auto prefix =
      tokenizer_.Decode(all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_);
  if (!prefix.ok()) return prefix.status();
  auto text = tokenizer_.Decode(all.subspan(prefix_offset_), skip_special_);
  if (!text.ok()) return text.status();
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const bool incomplete =
      text->size() >= kReplacement.size() &&
      text->compare(text->size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0;
  if (!final && (text->size() <= prefix->size() || incomplete)) return std::string();
  std::string out = text->size() > prefix->size() ? text->substr(prefix->size()) : std::string();
  // The next window starts at the newest token that decodes to some text on its own: decoders
  // strip leading spaces at the start of a text (SentencePiece strips all of them), so a window
  // starting at a lone space token would lose the space of the token after it.
  for (size_t p = read_offset_; p > prefix_offset_; --p) {
    if (p >= ids_.size()) continue;
    auto alone = tokenizer_.Decode(all.subspan(p, 1), skip_special_);
    if (alone.ok() && !alone->empty()) {
      prefix_offset_ = p;
      break;
    }
  }
  read_offset_ = ids_.size();
  return out;
}

}  // namespace tgis

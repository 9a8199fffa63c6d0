// The tokenizer.json pipeline: added tokens, normalizer, pre-tokenizer, model,
// post-processor and decoder, in HF tokenizers' order.
#include "tokenizer/src/hf_tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/added_vocabulary.h"
#include "tokenizer/src/byte_level_fast_path.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

class HfTokenizer : public Tokenizer {
 public:
  absl::Status Init(const Json& root, const std::string& file);

  absl::StatusOr<Encoding> Encode(std::string_view text, bool add_special_tokens) const override;
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens) const override;
  std::optional<std::string> IdToToken(int32_t id) const override {
    const std::string* t = TokenPtr(id);
    if (t == nullptr) return std::nullopt;
    return *t;
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (auto id = added_.ByContent(token)) return id;
    return model_->TokenToId(token);
  }
  size_t VocabSize() const override {
    return std::max<size_t>(model_->VocabSize(), static_cast<size_t>(added_.MaxId() + 1));
  }
  bool IsSpecial(int32_t id) const override {
    const std::string* t = TokenPtr(id);
    return t != nullptr && added_.IsSpecialContent(*t);
  }
  std::optional<std::string> TokenBytes(int32_t id) const override {
    const std::string* t = TokenPtr(id);
    if (t == nullptr || IsSpecial(id)) return std::nullopt;
    if (!decoder_) return " " + *t;  // Decode joins tokens with spaces
    bool whole_text = false;
    return decoder_->MidPiece(*t, &whole_text);
  }
  bool DecodesAsByteGroup(int32_t id) const override {
    if (!byte_fallback_decoder_) return false;
    const std::string* t = TokenPtr(id);
    return t != nullptr && t->size() == 6 && t->compare(0, 3, "<0x") == 0 && (*t)[5] == '>';
  }

 private:
  absl::Status EncodeGeneral(std::string_view text, RawEncoding* out) const;
  const std::string* TokenPtr(int32_t id) const {
    if (const AddedToken* a = added_.ById(id)) return &a->content;
    return model_->IdToToken(id);
  }

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<PostProcessor> post_processor_;
  std::unique_ptr<Decoder> decoder_;
  AddedVocabulary added_;
  std::unique_ptr<ByteLevelFastPath> fast_path_;
  bool byte_fallback_decoder_ = false;
};

bool HasDecoderType(const Json& j, std::string_view type) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == type) return true;
  if (auto it = j.find("decoders"); it != j.end() && it->is_array()) {
    for (const Json& d : *it) {
      if (HasDecoderType(d, type)) return true;
    }
  }
  return false;
}

absl::Status HfTokenizer::Init(const Json& root, const std::string& file) {
  auto prefix = [&file](const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat(file, ": ", st.message()));
  };
  if (!root.is_object()) return absl::InvalidArgumentError(file + ": expected a JSON object");
  auto get = [&root](const char* key) -> const Json* {
    auto it = root.find(key);
    return it == root.end() || it->is_null() ? nullptr : &*it;
  };
  if (const Json* j = get("normalizer")) {
    auto n = MakeNormalizer(*j, "normalizer");
    if (!n.ok()) return prefix(n.status());
    normalizer_ = std::move(*n);
  }
  if (const Json* j = get("pre_tokenizer")) {
    auto p = MakePreTokenizer(*j, "pre_tokenizer");
    if (!p.ok()) return prefix(p.status());
    pre_tokenizer_ = std::move(*p);
  }
  const Json* model = get("model");
  if (model == nullptr) return absl::InvalidArgumentError(file + ": model: missing field");
  auto m = MakeModel(*model, "model");
  if (!m.ok()) return prefix(m.status());
  model_ = std::move(*m);
  if (const Json* j = get("post_processor")) {
    auto p = MakePostProcessor(*j, "post_processor");
    if (!p.ok()) return prefix(p.status());
    post_processor_ = std::move(*p);
  }
  if (const Json* j = get("decoder")) {
    auto d = MakeDecoder(*j, "decoder");
    if (!d.ok()) return prefix(d.status());
    decoder_ = std::move(*d);
    byte_fallback_decoder_ = HasDecoderType(*j, "ByteFallback");
  }
  if (const Json* j = get("added_tokens")) {
    auto model_id = [this](std::string_view s) { return model_->TokenToId(s); };
    if (auto st = added_.Load(*j, "added_tokens", normalizer_.get(), model_id); !st.ok()) {
      return prefix(st);
    }
  }
  fast_path_ = ByteLevelFastPath::Build(root);
  return absl::OkStatus();
}

absl::StatusOr<Encoding> HfTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  if (size_t bad = FirstInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("input is not valid UTF-8 (byte ", bad, ")"));
  }
  RawEncoding raw;
  if (fast_path_ && fast_path_->Applicable(text)) {
    if (auto st = fast_path_->Encode(text, added_, *model_, &raw); !st.ok()) return st;
  } else if (auto st = EncodeGeneral(text, &raw); !st.ok()) {
    return st;
  }
  if (post_processor_) post_processor_->Process(&raw, add_special_tokens);
  Encoding enc;
  enc.ids = std::move(raw.ids);
  enc.tokens = std::move(raw.tokens);
  enc.offsets.reserve(raw.offsets.size());
  for (Span s : raw.offsets) enc.offsets.push_back(TokenOffset{s.start, s.end});
  return enc;
}

absl::Status HfTokenizer::EncodeGeneral(std::string_view text, RawEncoding* out) const {
  RawEncoding& raw = *out;
  PreTokenizedString pts;
  added_.ExtractAndNormalize(text, normalizer_.get(), &pts);
  if (pre_tokenizer_) {
    if (auto st = pre_tokenizer_->PreTokenize(&pts); !st.ok()) return st;
  }
  std::vector<Token> tokens;
  for (auto& piece : pts.pieces) {
    tokens.clear();
    const std::vector<Token>* src = &piece.tokens;
    if (!piece.has_tokens) {
      if (auto st = model_->Tokenize(piece.text.get(), &tokens); !st.ok()) return st;
      src = &tokens;
    }
    const uint32_t shift = static_cast<uint32_t>(piece.text.original_shift());
    for (const Token& t : *src) {
      Span o = piece.text.ToOriginal(t.offsets.start, t.offsets.end);
      raw.ids.push_back(t.id);
      raw.tokens.push_back(t.value);
      raw.offsets.push_back(Span{o.start + shift, o.end + shift});
      raw.special.push_back(0);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> HfTokenizer::Decode(std::span<const int32_t> ids,
                                                bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* t = TokenPtr(id);
    if (t == nullptr) continue;
    if (skip_special_tokens && added_.IsSpecialContent(*t)) continue;
    tokens.push_back(*t);
  }
  if (!decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out.push_back(' ');
      out += tokens[i];
    }
    return out;
  }
  std::string out;
  for (const std::string& s : decoder_->DecodeChain(std::move(tokens))) out += s;
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(file, ": cannot open"));
  std::stringstream buf;
  buf << in.rdbuf();
  Json root = Json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    // Parse again with exceptions off but a callback-free error position: nlohmann only
    // reports positions through exceptions, so catch it locally.
    try {
      const Json unused = Json::parse(buf.str());  // throws: the error is the point
      (void)unused;
    } catch (const Json::exception& e) {  // parse_error, or out_of_range for 1e500
      return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON: ", e.what()));
    }
    return absl::InvalidArgumentError(absl::StrCat(file, ": invalid JSON"));
  }
  return LoadHfTokenizerJson(root, file);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizerJson(const Json& root,
                                                               const std::string& where) {
  auto tok = std::make_unique<HfTokenizer>();
  try {
    if (auto st = tok->Init(root, where); !st.ok()) return st;
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unexpected value: ", e.what()));
  }
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

}  // namespace tgis::tok

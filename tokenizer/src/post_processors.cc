// Post-processors of tokenizer.json (single-sequence encodings; pairs are not used by a
// generation server).
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/byte_level.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

// Moves offsets past the leading/trailing spaces a byte-level token carries (as 'Ġ').
void TrimByteLevelOffsets(RawEncoding* enc, bool add_prefix_space) {
  const char32_t space = GetByteLevelTable().byte_to_char[' '];
  for (size_t i = 0; i < enc->ids.size(); ++i) {
    const std::string& tok = enc->tokens[i];
    std::vector<char32_t> chars;
    for (size_t p = 0; p < tok.size();) {
      char32_t c;
      p += Utf8Decode(tok, p, &c);
      chars.push_back(c);
    }
    auto is_space = [space](char32_t c) { return c == space || IsWhitespace(c); };
    size_t leading = 0;
    while (leading < chars.size() && is_space(chars[leading])) ++leading;
    size_t trailing = 0;
    while (trailing < chars.size() && is_space(chars[chars.size() - 1 - trailing])) ++trailing;
    Span& off = enc->offsets[i];
    if (leading > 0) {
      const bool is_first = i == 0 || off.start == 0;
      if (is_first && add_prefix_space && leading == 1) leading = 0;
      off.start = std::min<uint32_t>(off.start + leading, off.end);
    }
    if (trailing > 0 && off.end >= trailing) {
      off.end = std::max<uint32_t>(off.end - trailing, off.start);
    }
  }
}

class ByteLevelProcessor : public PostProcessor {
 public:
  ByteLevelProcessor(bool trim, bool add_prefix_space)
      : trim_(trim), add_prefix_space_(add_prefix_space) {}
  void Process(RawEncoding* enc, bool) const override {
    if (trim_) TrimByteLevelOffsets(enc, add_prefix_space_);
  }

 private:
  bool trim_, add_prefix_space_;
};

struct SpecialPiece {
  std::vector<int32_t> ids;
  std::vector<std::string> tokens;
};

void Insert(RawEncoding* out, const SpecialPiece& p) {
  for (size_t k = 0; k < p.ids.size(); ++k) {
    out->ids.push_back(p.ids[k]);
    out->tokens.push_back(p.tokens[k]);
    out->offsets.push_back(Span{0, 0});
    out->special.push_back(1);
  }
}

void AppendAll(RawEncoding* out, const RawEncoding& in) {
  out->ids.insert(out->ids.end(), in.ids.begin(), in.ids.end());
  out->tokens.insert(out->tokens.end(), in.tokens.begin(), in.tokens.end());
  out->offsets.insert(out->offsets.end(), in.offsets.begin(), in.offsets.end());
  out->special.insert(out->special.end(), in.special.begin(), in.special.end());
}

class TemplateProcessor : public PostProcessor {
 public:
  struct Item {
    bool is_sequence;
    SpecialPiece special;
  };
  explicit TemplateProcessor(std::vector<Item> single) : single_(std::move(single)) {}
  void Process(RawEncoding* enc, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    RawEncoding out;
    for (const Item& it : single_) {
      if (it.is_sequence) {
        AppendAll(&out, *enc);
      } else {
        Insert(&out, it.special);
      }
    }
    *enc = std::move(out);
  }
  size_t AddedTokens() const override {
    size_t n = 0;
    for (const Item& it : single_) n += it.is_sequence ? 0 : it.special.ids.size();
    return n;
  }

 private:
  std::vector<Item> single_;
};

class ClsSepProcessor : public PostProcessor {
 public:
  ClsSepProcessor(SpecialPiece cls, SpecialPiece sep, bool trim, bool add_prefix_space)
      : cls_(std::move(cls)), sep_(std::move(sep)), trim_(trim), aps_(add_prefix_space) {}
  void Process(RawEncoding* enc, bool add_special_tokens) const override {
    if (trim_) TrimByteLevelOffsets(enc, aps_);
    if (!add_special_tokens) return;
    RawEncoding out;
    Insert(&out, cls_);
    AppendAll(&out, *enc);
    Insert(&out, sep_);
    *enc = std::move(out);
  }
  size_t AddedTokens() const override { return 2; }

 private:
  SpecialPiece cls_, sep_;
  bool trim_, aps_;
};

class SequenceProcessor : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void Process(RawEncoding* enc, bool add_special_tokens) const override {
    for (const auto& p : parts_) p->Process(enc, add_special_tokens);
  }
  size_t AddedTokens() const override {
    size_t n = 0;
    for (const auto& p : parts_) n += p->AddedTokens();
    return n;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

absl::StatusOr<SpecialPiece> TokenIdPair(const Json& j, const std::string& path, const char* key) {
  auto f = Field(j, path, key);
  if (!f.ok()) return f.status();
  const Json& v = **f;
  if (!v.is_array() || v.size() != 2 || !v[0].is_string() || !v[1].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected [token, id]"));
  }
  auto id = TokenId(v[1], absl::StrCat(path, ".", key, "[1]"));
  if (!id.ok()) return id.status();
  return SpecialPiece{{*id}, {v[0].get<std::string>()}};
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostProcessor>> MakePostProcessor(const Json& j,
                                                                 const std::string& path) {
  auto type = StringField(j, path, "type");
  if (!type.ok()) return type.status();
  const std::string& t = *type;
  if (t == "ByteLevel") {
    auto trim = BoolField(j, path, "trim_offsets", true);
    auto aps = BoolField(j, path, "add_prefix_space", true);
    if (!trim.ok()) return trim.status();
    if (!aps.ok()) return aps.status();
    return std::make_unique<ByteLevelProcessor>(*trim, *aps);
  }
  if (t == "TemplateProcessing") {
    auto single = Field(j, path, "single");
    if (!single.ok()) return single.status();
    auto specials = Field(j, path, "special_tokens");
    if (!specials.ok()) return specials.status();
    std::vector<TemplateProcessor::Item> items;
    size_t i = 0;
    for (const Json& piece : **single) {
      const std::string ipath = absl::StrCat(path, ".single[", i++, "]");
      if (piece.contains("Sequence")) {
        items.push_back({true, {}});
        continue;
      }
      if (!piece.contains("SpecialToken") || !piece["SpecialToken"].contains("id")) {
        return absl::InvalidArgumentError(ipath + ": expected Sequence or SpecialToken");
      }
      const std::string id = piece["SpecialToken"]["id"].get<std::string>();
      auto it = (*specials)->find(id);
      if (it == (*specials)->end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ".special_tokens: missing '", id, "' used by the template"));
      }
      // Found by fuzzing: (*it)["ids"] on a const object without that key is undefined
      // behaviour in nlohmann (it read freed memory); every field is looked up and typed.
      const std::string spath = absl::StrCat(path, ".special_tokens[\"", id, "\"]");
      auto ids = Field(*it, spath, "ids");
      if (!ids.ok()) return ids.status();
      auto tokens = Field(*it, spath, "tokens");
      if (!tokens.ok()) return tokens.status();
      if (!(*ids)->is_array() || !(*tokens)->is_array()) {
        return absl::InvalidArgumentError(spath + ": ids and tokens must be arrays");
      }
      SpecialPiece sp;
      for (const Json& x : **ids) {
        auto checked = TokenId(x, spath + ".ids");
        if (!checked.ok()) return checked.status();
        sp.ids.push_back(*checked);
      }
      for (const Json& x : **tokens) {
        if (!x.is_string()) return absl::InvalidArgumentError(spath + ".tokens: expected strings");
        sp.tokens.push_back(x.get<std::string>());
      }
      if (sp.ids.size() != sp.tokens.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ".special_tokens[\"", id, "\"]: ids and tokens differ in length"));
      }
      items.push_back({false, std::move(sp)});
    }
    return std::make_unique<TemplateProcessor>(std::move(items));
  }
  if (t == "RobertaProcessing" || t == "BertProcessing") {
    auto cls = TokenIdPair(j, path, "cls");
    auto sep = TokenIdPair(j, path, "sep");
    if (!cls.ok()) return cls.status();
    if (!sep.ok()) return sep.status();
    bool trim = false, aps = false;
    if (t == "RobertaProcessing") {
      auto tr = BoolField(j, path, "trim_offsets", true);
      auto ap = BoolField(j, path, "add_prefix_space", true);
      if (!tr.ok()) return tr.status();
      if (!ap.ok()) return ap.status();
      trim = *tr;
      aps = *ap;
    }
    return std::make_unique<ClsSepProcessor>(std::move(*cls), std::move(*sep), trim, aps);
  }
  if (t == "Sequence") {
    auto list = Field(j, path, "processors");
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<PostProcessor>> parts;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto p = MakePostProcessor((**list)[i], absl::StrCat(path, ".processors[", i, "]"));
      if (!p.ok()) return p.status();
      parts.push_back(std::move(*p));
    }
    return std::make_unique<SequenceProcessor>(std::move(parts));
  }
  return Unsupported(path, absl::StrCat("post_processor type '", t, "'"));
}

}  // namespace tgis::tok

// Normalizers of tokenizer.json, each reproducing HF tokenizers' edits and alignments.
#include <unicode/uchar.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/pattern.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/precompiled.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void Normalize(NormalizedString* s) const override {
    for (const auto& p : parts_) p->Normalize(s);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void Normalize(NormalizedString* s) const override { s->Normalize(static_cast<int>(form_)); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void Normalize(NormalizedString* s) const override { s->Lowercase(); }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void Normalize(NormalizedString* s) const override { s->Strip(left_, right_); }

 private:
  bool left_, right_;
};

bool IsCombiningMark(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_M_MASK) != 0;
}

class StripAccentsNormalizer : public Normalizer {
 public:
  void Normalize(NormalizedString* s) const override {
    s->Filter([](char32_t c) { return !IsCombiningMark(c); });
  }
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void Normalize(NormalizedString* s) const override {
    s->Replace(pattern_.FindMatches(s->get()), content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  void Normalize(NormalizedString* s) const override { s->Prepend(prepend_); }

 private:
  std::string prepend_;
};

class AppendNormalizer : public Normalizer {
 public:
  explicit AppendNormalizer(std::string append) : append_(std::move(append)) {}
  void Normalize(NormalizedString* s) const override { s->Append(append_); }

 private:
  std::string append_;
};

// SentencePiece's "nmt_nfkc" pre-pass without the NFKC: drop ASCII controls, map exotic
// spaces to ' '.
class NmtNormalizer : public Normalizer {
 public:
  void Normalize(NormalizedString* s) const override {
    s->Filter([](char32_t c) {
      return !((c >= 0x01 && c <= 0x08) || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F ||
               c == 0x8F || c == 0x9F);
    });
    s->Map([](char32_t c) -> char32_t {
      switch (c) {
        case 0x09:
        case 0x0A:
        case 0x0C:
        case 0x0D:
        case 0x1680:
        case 0x200B:
        case 0x200C:
        case 0x200D:
        case 0x200E:
        case 0x200F:
        case 0x2028:
        case 0x2029:
        case 0x2581:
        case 0xFEFF:
        case 0xFFFD:
          return U' ';
        default:
          return c;
      }
    });
  }
};

class PrecompiledNormalizer : public Normalizer {
 public:
  explicit PrecompiledNormalizer(PrecompiledCharsMap map) : map_(std::move(map)) {}
  void Normalize(NormalizedString* s) const override {
    if (map_.empty()) return;
    const std::string& text = s->get();
    std::vector<CharChange> dest;
    dest.reserve(text.size());
    bool modified = false;
    auto replace = [&dest](std::string_view old_part, std::string_view new_part) {
      long old_count = 0, new_count = 0;
      for (size_t i = 0; i < old_part.size(); i += Utf8SeqLen(old_part[i])) ++old_count;
      for (size_t i = 0; i < new_part.size();) {
        char32_t c;
        i += Utf8Decode(new_part, i, &c);
        dest.push_back({c, 0});
        ++new_count;
      }
      long diff = new_count - old_count;
      if (diff > 0) {
        for (long k = 0; k < diff; ++k) dest[dest.size() - 1 - k].change = 1;
      } else if (diff < 0 && !dest.empty()) {
        dest.back().change += static_cast<int>(diff);
      }
    };
    size_t start = 0;
    for (size_t end : GraphemeBoundaries(text)) {
      std::string_view g(text.data() + start, end - start);
      start = end;
      if (g.size() < 6) {
        if (auto norm = map_.Transform(g)) {
          modified = true;
          replace(g, *norm);
          continue;
        }
      }
      for (size_t i = 0; i < g.size();) {
        char32_t c;
        int n = Utf8Decode(g, i, &c);
        std::string_view part = g.substr(i, n);
        if (auto norm = map_.Transform(part)) {
          modified = true;
          replace(part, *norm);
        } else {
          dest.push_back({c, 0});
        }
        i += n;
      }
    }
    if (modified) s->Transform(dest, 0);
  }

 private:
  PrecompiledCharsMap map_;
};

bool IsChineseChar(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

class BertNormalizer : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool chinese, bool strip_accents, bool lowercase)
      : clean_text_(clean_text),
        chinese_(chinese),
        strip_accents_(strip_accents),
        lowercase_(lowercase) {}
  void Normalize(NormalizedString* s) const override {
    if (clean_text_) {
      s->Filter([](char32_t c) {
        if (c == 0 || c == 0xFFFD) return false;
        if (c == '\t' || c == '\n' || c == '\r') return true;
        int8_t t = u_charType(static_cast<UChar32>(c));
        return !(t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_UNASSIGNED ||
                 t == U_PRIVATE_USE_CHAR);
      });
      s->Map([](char32_t c) -> char32_t {
        bool ws = c == '\t' || c == '\n' || c == '\r' || c == ' ' ||
                  u_charType(static_cast<UChar32>(c)) == U_SPACE_SEPARATOR;
        return ws ? U' ' : c;
      });
    }
    if (chinese_) {
      std::vector<CharChange> dest;
      const std::string& t = s->get();
      bool any = false;
      for (size_t i = 0; i < t.size();) {
        char32_t c;
        i += Utf8Decode(t, i, &c);
        if (IsChineseChar(c)) {
          any = true;
          dest.push_back({U' ', 0});
          dest.push_back({c, 1});
          dest.push_back({U' ', 1});
        } else {
          dest.push_back({c, 0});
        }
      }
      if (any) s->Transform(dest, 0);
    }
    if (strip_accents_) {
      s->Normalize(static_cast<int>(NormalForm::kNfd));
      s->Filter(
          [](char32_t c) { return u_charType(static_cast<UChar32>(c)) != U_NON_SPACING_MARK; });
    }
    if (lowercase_) s->Lowercase();
  }

 private:
  bool clean_text_, chinese_, strip_accents_, lowercase_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const Json& j, const std::string& path) {
  auto type = StringField(j, path, "type");
  if (!type.ok()) return type.status();
  const std::string& t = *type;
  if (t == "Sequence") {
    auto list = Field(j, path, "normalizers");
    if (!list.ok()) return list.status();
    if (!(*list)->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".normalizers: expected an array"));
    }
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto n = MakeNormalizer((**list)[i], absl::StrCat(path, ".normalizers[", i, "]"));
      if (!n.ok()) return n.status();
      parts.push_back(std::move(*n));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  if (t == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfc);
  if (t == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfd);
  if (t == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkc);
  if (t == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkd);
  if (t == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (t == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (t == "Nmt") return std::make_unique<NmtNormalizer>();
  if (t == "Strip") {
    auto l = BoolField(j, path, "strip_left", true);
    auto r = BoolField(j, path, "strip_right", true);
    if (!l.ok()) return l.status();
    if (!r.ok()) return r.status();
    return std::make_unique<StripNormalizer>(*l, *r);
  }
  if (t == "Replace") {
    auto pat = Field(j, path, "pattern");
    if (!pat.ok()) return pat.status();
    auto p = Pattern::FromJson(**pat, path + ".pattern");
    if (!p.ok()) return p.status();
    auto content = StringField(j, path, "content");
    if (!content.ok()) return content.status();
    return std::make_unique<ReplaceNormalizer>(std::move(*p), *content);
  }
  if (t == "Prepend") {
    auto s = StringField(j, path, "prepend");
    if (!s.ok()) return s.status();
    return std::make_unique<PrependNormalizer>(*s);
  }
  if (t == "Append") {
    auto s = StringField(j, path, "append");
    if (!s.ok()) return s.status();
    return std::make_unique<AppendNormalizer>(*s);
  }
  if (t == "Precompiled") {
    auto f = Field(j, path, "precompiled_charsmap");
    if (!f.ok()) return f.status();
    std::string blob;
    if ((*f)->is_string()) {
      auto decoded = Base64Decode((*f)->get<std::string>());
      if (!decoded.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ".precompiled_charsmap: ", decoded.status().message()));
      }
      blob = std::move(*decoded);
    } else if ((*f)->is_array()) {
      for (const auto& b : **f) {
        if (!b.is_number_integer() || b.get<int64_t>() < 0 || b.get<int64_t>() > 255) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ".precompiled_charsmap: ", b.dump(), " is not a byte"));
        }
        blob.push_back(static_cast<char>(b.get<int64_t>()));
      }
    } else if (!(*f)->is_null()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".precompiled_charsmap: expected a base64 string"));
    }
    auto map = PrecompiledCharsMap::Parse(blob);
    if (!map.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ".precompiled_charsmap: ", map.status().message()));
    }
    return std::make_unique<PrecompiledNormalizer>(std::move(*map));
  }
  if (t == "BertNormalizer") {
    auto clean = BoolField(j, path, "clean_text", true);
    auto chinese = BoolField(j, path, "handle_chinese_chars", true);
    auto lower = BoolField(j, path, "lowercase", true);
    if (!clean.ok()) return clean.status();
    if (!chinese.ok()) return chinese.status();
    if (!lower.ok()) return lower.status();
    auto strip = BoolField(j, path, "strip_accents", *lower);
    if (!strip.ok()) return strip.status();
    return std::make_unique<BertNormalizer>(*clean, *chinese, *strip, *lower);
  }
  return Unsupported(path, absl::StrCat("normalizer type '", t, "'"));
}

}  // namespace tgis::tok

// Pre-tokenizers of tokenizer.json, reproducing HF tokenizers' splits and alignments.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/byte_level.h"
#include "tokenizer/src/pattern.h"
#include "tokenizer/src/pipeline.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {

constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  absl::Status PreTokenize(PreTokenizedString* s) const override {
    for (const auto& p : parts_) {
      absl::Status st = p->PreTokenize(s);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  absl::Status PreTokenize(PreTokenizedString* s) const override {
    absl::Status st = s->SplitEach([&](NormalizedString& ns, std::vector<NormalizedString>* out) {
      if (add_prefix_space_ && (ns.get().empty() || ns.get()[0] != ' ')) ns.Prepend(" ");
      if (regex_) {
        *out = ns.Split(regex_->FindMatches(ns.get()), SplitBehavior::kIsolated);
      } else {
        out->push_back(std::move(ns));
      }
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
    const ByteLevelTable& table = GetByteLevelTable();
    for (auto& piece : s->pieces) {
      if (piece.has_tokens) continue;
      const std::string& text = piece.text.get();
      std::vector<CharChange> dest;
      dest.reserve(text.size());
      for (size_t i = 0; i < text.size();) {
        int n = Utf8SeqLen(static_cast<unsigned char>(text[i]));
        for (int k = 0; k < n; ++k) {
          dest.push_back({table.byte_to_char[static_cast<unsigned char>(text[i + k])], k > 0});
        }
        i += n;
      }
      piece.text.Transform(dest, 0);
    }
    return absl::OkStatus();
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<Regex> regex_;
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  absl::Status PreTokenize(PreTokenizedString* s) const override {
    return s->SplitEach([&](NormalizedString& ns, std::vector<NormalizedString>* out) {
      std::vector<MatchSpan> m = pattern_.FindMatches(ns.get());
      if (invert_) {
        for (auto& x : m) x.is_match = !x.is_match;
      }
      *out = ns.Split(m, behavior_);
      return absl::OkStatus();
    });
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class PredicatePreTokenizer : public PreTokenizer {
 public:
  PredicatePreTokenizer(std::function<bool(char32_t)> pred, SplitBehavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  absl::Status PreTokenize(PreTokenizedString* s) const override {
    return s->SplitEach([&](NormalizedString& ns, std::vector<NormalizedString>* out) {
      *out = ns.Split(MatchCharPredicate(ns.get(), pred_), behavior_);
      return absl::OkStatus();
    });
  }

 private:
  std::function<bool(char32_t)> pred_;
  SplitBehavior behavior_;
};

enum class PrependScheme { kFirst, kNever, kAlways };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(char32_t replacement, PrependScheme scheme, bool split)
      : replacement_(replacement), rep_(ToUtf8(replacement)), scheme_(scheme), split_(split) {}
  absl::Status PreTokenize(PreTokenizedString* s) const override {
    return s->SplitEach([&](NormalizedString& ns, std::vector<NormalizedString>* out) {
      ns.Replace(MatchLiteral(ns.get(), " "), rep_);
      bool starts = ns.get().compare(0, rep_.size(), rep_) == 0;
      if (!starts) {
        if (scheme_ == PrependScheme::kAlways ||
            (scheme_ == PrependScheme::kFirst && ns.original_shift() == 0)) {
          ns.Prepend(rep_);
        }
      }
      if (split_) {
        char32_t r = replacement_;
        *out = ns.Split(MatchCharPredicate(ns.get(), [r](char32_t c) { return c == r; }),
                        SplitBehavior::kMergedWithNext);
      } else {
        out->push_back(std::move(ns));
      }
      return absl::OkStatus();
    });
  }

 private:
  char32_t replacement_;
  std::string rep_;
  PrependScheme scheme_;
  bool split_;
};

absl::StatusOr<SplitBehavior> ParseBehavior(const Json& j, const std::string& path,
                                            SplitBehavior default_value) {
  auto it = j.find("behavior");
  if (it == j.end() || it->is_null()) return default_value;
  std::string b = it->is_string() ? it->get<std::string>() : "";
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return absl::InvalidArgumentError(absl::StrCat(path, ".behavior: unknown value"));
}

absl::StatusOr<char32_t> SingleChar(const Json& j, const std::string& path, const char* key) {
  auto s = StringField(j, path, key);
  if (!s.ok()) return s.status();
  if (s->empty() || !IsValidUtf8(*s)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected one character"));
  }
  char32_t c;
  size_t n = Utf8Decode(*s, 0, &c);
  if (n != s->size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ".", key, ": expected one character"));
  }
  return c;
}

std::shared_ptr<Regex> Gpt2Regex() {
  static std::shared_ptr<Regex> re = [] {
    return std::shared_ptr<Regex>(*Regex::Compile(kGpt2Pattern));
  }();
  return re;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreTokenizer>> MakePreTokenizer(const Json& j,
                                                               const std::string& path) {
  auto type = StringField(j, path, "type");
  if (!type.ok()) return type.status();
  const std::string& t = *type;
  if (t == "Sequence") {
    auto list = Field(j, path, "pretokenizers");
    if (!list.ok()) return list.status();
    if (!(*list)->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".pretokenizers: expected an array"));
    }
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto p = MakePreTokenizer((**list)[i], absl::StrCat(path, ".pretokenizers[", i, "]"));
      if (!p.ok()) return p.status();
      parts.push_back(std::move(*p));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (t == "ByteLevel") {
    auto aps = BoolField(j, path, "add_prefix_space", true);
    auto use_regex = BoolField(j, path, "use_regex", true);
    if (!aps.ok()) return aps.status();
    if (!use_regex.ok()) return use_regex.status();
    return std::make_unique<ByteLevelPreTokenizer>(*aps, *use_regex ? Gpt2Regex() : nullptr);
  }
  if (t == "Split") {
    auto pat = Field(j, path, "pattern");
    if (!pat.ok()) return pat.status();
    auto p = Pattern::FromJson(**pat, path + ".pattern");
    if (!p.ok()) return p.status();
    auto behavior = ParseBehavior(j, path, SplitBehavior::kIsolated);
    if (!behavior.ok()) return behavior.status();
    auto invert = BoolField(j, path, "invert", false);
    if (!invert.ok()) return invert.status();
    return std::make_unique<SplitPreTokenizer>(std::move(*p), *behavior, *invert);
  }
  if (t == "Metaspace") {
    auto rep = SingleChar(j, path, "replacement");
    if (!rep.ok()) return rep.status();
    PrependScheme scheme = PrependScheme::kAlways;
    if (auto it = j.find("prepend_scheme"); it != j.end() && it->is_string()) {
      std::string s = it->get<std::string>();
      if (s == "first") {
        scheme = PrependScheme::kFirst;
      } else if (s == "never") {
        scheme = PrependScheme::kNever;
      } else if (s == "always") {
        scheme = PrependScheme::kAlways;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(path, ".prepend_scheme: unknown value"));
      }
    } else {
      auto aps = BoolField(j, path, "add_prefix_space", true);
      if (!aps.ok()) return aps.status();
      scheme = *aps ? PrependScheme::kAlways : PrependScheme::kNever;
    }
    auto split = BoolField(j, path, "split", true);
    if (!split.ok()) return split.status();
    return std::make_unique<MetaspacePreTokenizer>(*rep, scheme, *split);
  }
  if (t == "Digits") {
    auto individual = BoolField(j, path, "individual_digits", false);
    if (!individual.ok()) return individual.status();
    return std::make_unique<PredicatePreTokenizer>(
        [](char32_t c) { return IsNumeric(c); },
        *individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }
  if (t == "Punctuation") {
    auto behavior = ParseBehavior(j, path, SplitBehavior::kIsolated);
    if (!behavior.ok()) return behavior.status();
    return std::make_unique<PredicatePreTokenizer>([](char32_t c) { return IsPunctuation(c); },
                                                   *behavior);
  }
  if (t == "WhitespaceSplit") {
    return std::make_unique<PredicatePreTokenizer>([](char32_t c) { return IsWhitespace(c); },
                                                   SplitBehavior::kRemoved);
  }
  if (t == "CharDelimiterSplit") {
    auto d = SingleChar(j, path, "delimiter");
    if (!d.ok()) return d.status();
    char32_t delim = *d;
    return std::make_unique<PredicatePreTokenizer>([delim](char32_t c) { return c == delim; },
                                                   SplitBehavior::kRemoved);
  }
  if (t == "Whitespace") {
    auto re = Regex::Compile(R"(\w+|[^\w\s]+)");
    if (!re.ok()) return re.status();
    Json pj = {{"Regex", R"(\w+|[^\w\s]+)"}};
    auto p = Pattern::FromJson(pj, path);
    if (!p.ok()) return p.status();
    return std::make_unique<SplitPreTokenizer>(std::move(*p), SplitBehavior::kRemoved, true);
  }
  if (t == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    parts.push_back(std::make_unique<PredicatePreTokenizer>(
        [](char32_t c) { return IsWhitespace(c); }, SplitBehavior::kRemoved));
    parts.push_back(std::make_unique<PredicatePreTokenizer>(
        [](char32_t c) { return IsPunctuation(c); }, SplitBehavior::kIsolated));
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  return Unsupported(path, absl::StrCat("pre_tokenizer type '", t, "'"));
}

}  // namespace tgis::tok

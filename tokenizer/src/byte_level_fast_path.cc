#include "tokenizer/src/byte_level_fast_path.h"

#include <nlohmann/json.hpp>

#include "tokenizer/src/byte_level.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
}  // namespace

std::unique_ptr<ByteLevelFastPath> ByteLevelFastPath::Build(const Json& root) {
  auto path = std::make_unique<ByteLevelFastPath>();
  const Json& norm = root.contains("normalizer") ? root["normalizer"] : Json();
  if (norm.is_object()) {
    if (norm.value("type", "") != "NFC") return nullptr;
    path->nfc_ = true;
  } else if (!norm.is_null()) {
    return nullptr;
  }
  const Json& pre = root.contains("pre_tokenizer") ? root["pre_tokenizer"] : Json();
  if (!pre.is_object()) return nullptr;
  std::vector<const Json*> list;
  if (pre.value("type", "") == "Sequence") {
    if (!pre.contains("pretokenizers") || !pre["pretokenizers"].is_array()) return nullptr;
    for (const Json& p : pre["pretokenizers"]) list.push_back(&p);
  } else {
    list.push_back(&pre);
  }
  if (list.empty()) return nullptr;
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& p = *list[i];
    const std::string type = p.value("type", "");
    const bool last = i + 1 == list.size();
    if (type == "ByteLevel") {
      if (!last || p.value("add_prefix_space", true)) return nullptr;
      if (p.value("use_regex", true)) {
        auto pat = Pattern::FromJson(Json{{"Regex", kGpt2Pattern}}, "");
        if (!pat.ok()) return nullptr;
        path->stages_.push_back(
            {std::make_unique<Pattern>(std::move(*pat)), SplitBehavior::kIsolated});
      }
    } else if (type == "Split") {
      if (last || p.value("invert", false) || p.value("behavior", "") != "Isolated" ||
          !p.contains("pattern")) {
        return nullptr;
      }
      auto pat = Pattern::FromJson(p["pattern"], "");
      if (!pat.ok()) return nullptr;
      path->stages_.push_back(
          {std::make_unique<Pattern>(std::move(*pat)), SplitBehavior::kIsolated});
    } else if (type == "Digits") {
      if (last) return nullptr;
      path->stages_.push_back({nullptr, p.value("individual_digits", false)
                                            ? SplitBehavior::kIsolated
                                            : SplitBehavior::kContiguous});
    } else {
      return nullptr;
    }
  }
  if (list.back()->value("type", "") != "ByteLevel") return nullptr;
  return path;
}

bool ByteLevelFastPath::Applicable(std::string_view text) const {
  return !nfc_ || IsNormalized(text, NormalForm::kNfc);
}

void ByteLevelFastPath::Split(std::string_view text, size_t base, size_t stage,
                              std::vector<std::pair<size_t, size_t>>* out) const {
  if (text.empty()) return;
  if (stage == stages_.size()) {
    out->emplace_back(base, base + text.size());
    return;
  }
  const Stage& st = stages_[stage];
  std::vector<MatchSpan> matches =
      st.pattern ? st.pattern->FindMatches(text)
                 : MatchCharPredicate(text, [](char32_t c) { return IsNumeric(c); });
  for (auto [s, e] : SplitRanges(matches, st.behavior)) {
    Split(text.substr(s, e - s), base + s, stage + 1, out);
  }
}

absl::Status ByteLevelFastPath::Encode(std::string_view text, const AddedVocabulary& added,
                                       const Model& model, RawEncoding* out) const {
  const ByteLevelTable& table = GetByteLevelTable();
  std::vector<AddedVocabulary::TextSplit> raw, norm;
  std::vector<std::pair<size_t, size_t>> pieces;
  std::vector<Token> tokens;
  std::string mapped;
  std::vector<uint32_t> orig_of;  // mapped byte index -> original byte index in the piece

  auto add_token = [&](int32_t id, std::string value, size_t s, size_t e) {
    out->ids.push_back(id);
    out->tokens.push_back(std::move(value));
    out->offsets.push_back(Span{static_cast<uint32_t>(s), static_cast<uint32_t>(e)});
    out->special.push_back(0);
  };
  auto encode_plain = [&](size_t a, size_t b) -> absl::Status {
    pieces.clear();
    Split(text.substr(a, b - a), a, 0, &pieces);
    for (auto [ps, pe] : pieces) {
      mapped.clear();
      orig_of.clear();
      for (size_t i = ps; i < pe; ++i) {
        const std::string& m = table.byte_to_utf8[static_cast<unsigned char>(text[i])];
        for (size_t k = 0; k < m.size(); ++k) orig_of.push_back(static_cast<uint32_t>(i));
        mapped += m;
      }
      orig_of.push_back(static_cast<uint32_t>(pe));
      tokens.clear();
      if (auto st = model.Tokenize(mapped, &tokens); !st.ok()) return st;
      for (Token& t : tokens) {
        // Offsets cover whole characters of the input, as HF's alignments do.
        size_t s = orig_of[t.offsets.start];
        size_t e = orig_of[t.offsets.end - 1];
        auto lead = [&text](size_t i) {
          while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
          return i;
        };
        s = lead(s);
        e = lead(e);
        e += Utf8SeqLen(static_cast<unsigned char>(text[e]));
        add_token(t.id, std::move(t.value), s, e);
      }
    }
    return absl::OkStatus();
  };

  auto encode_unmatched = [&](size_t a, size_t b) -> absl::Status {
    if (!added.HasNormalized()) return encode_plain(a, b);
    added.FindSplits(text.substr(a, b - a), /*normalized=*/true, &norm);
    for (const auto& sp : norm) {
      if (sp.id >= 0) {
        add_token(sp.id, std::string(text.substr(a + sp.start, sp.end - sp.start)), a + sp.start,
                  a + sp.end);
      } else if (auto st = encode_plain(a + sp.start, a + sp.end); !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  };

  if (text.empty()) return absl::OkStatus();
  if (!added.HasRaw()) return encode_unmatched(0, text.size());
  added.FindSplits(text, /*normalized=*/false, &raw);
  for (const auto& sp : raw) {
    if (sp.id >= 0) {
      add_token(sp.id, std::string(text.substr(sp.start, sp.end - sp.start)), sp.start, sp.end);
    } else if (auto st = encode_unmatched(sp.start, sp.end); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace tgis::tok

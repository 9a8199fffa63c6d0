#include "tokenizer/src/added_vocabulary.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {

void AddedVocabulary::Matcher::Add(std::string_view pattern, int32_t token) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (char ch : pattern) {
    auto c = static_cast<unsigned char>(ch);
    auto it = nodes[node].next.find(c);
    if (it == nodes[node].next.end()) {
      nodes.push_back(Node{});
      int32_t idx = static_cast<int32_t>(nodes.size() - 1);
      nodes[node].next[c] = idx;
      node = idx;
    } else {
      node = it->second;
    }
  }
  nodes[node].token = token;
  first_byte[static_cast<unsigned char>(pattern[0])] = true;
}

absl::Status AddedVocabulary::Load(
    const Json& list, const std::string& path, const Normalizer* normalizer,
    const std::function<std::optional<int32_t>(std::string_view)>& model_id) {
  if (list.is_null()) return absl::OkStatus();
  if (!list.is_array()) return absl::InvalidArgumentError(path + ": expected an array");
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& e = list[i];
    const std::string p = absl::StrCat(path, "[", i, "]");
    AddedToken t;
    auto content = StringField(e, p, "content");
    if (!content.ok()) return content.status();
    auto id = Field(e, p, "id");
    if (!id.ok()) return id.status();
    auto checked = TokenId(**id, p + ".id");
    if (!checked.ok()) return checked.status();
    t.id = *checked;
    t.content = *content;
    auto flag = [&](const char* key, bool def, bool* out) -> absl::Status {
      auto v = BoolField(e, p, key, def);
      if (!v.ok()) return v.status();
      *out = *v;
      return absl::OkStatus();
    };
    if (auto st = flag("special", false, &t.special); !st.ok()) return st;
    if (auto st = flag("single_word", false, &t.single_word); !st.ok()) return st;
    if (auto st = flag("lstrip", false, &t.lstrip); !st.ok()) return st;
    if (auto st = flag("rstrip", false, &t.rstrip); !st.ok()) return st;
    if (auto st = flag("normalized", !t.special, &t.normalized); !st.ok()) return st;
    if (t.content.empty()) continue;
    if (!IsValidUtf8(t.content)) return absl::InvalidArgumentError(p + ".content: invalid UTF-8");
    if (auto in_model = model_id(t.content)) t.id = *in_model;
    size_t index = tokens_.size();
    if (auto it = by_content_.find(t.content); it != by_content_.end()) {
      tokens_[it->second] = t;  // a later entry for the same content wins
      index = it->second;
    } else {
      tokens_.push_back(t);
      by_content_[t.content] = index;
    }
    by_id_[t.id] = index;
    if (t.special) special_contents_.insert(t.content);
    max_id_ = std::max(max_id_, t.id);
  }
  // Special tokens come first in HF's matching sets, but with leftmost-longest matching the
  // order only matters for identical patterns, which cannot happen here.
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& t = tokens_[i];
    if (!t.normalized) {
      raw_.Add(t.content, static_cast<int32_t>(i));
    } else {
      NormalizedString ns(t.content);
      if (normalizer != nullptr) normalizer->Normalize(&ns);
      normalized_.Add(ns.get(), static_cast<int32_t>(i));
    }
  }
  return absl::OkStatus();
}

namespace {
bool EndsWithWord(std::string_view s) {
  if (s.empty()) return false;
  size_t b = s.size() - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  char32_t c;
  Utf8Decode(s, b, &c);
  return IsWordChar(c);
}
bool StartsWithWord(std::string_view s) {
  if (s.empty()) return false;
  char32_t c;
  Utf8Decode(s, 0, &c);
  return IsWordChar(c);
}
}  // namespace

void AddedVocabulary::FindSplits(std::string_view text, bool normalized,
                                 std::vector<TextSplit>* out) const {
  FindSplitsWith(normalized ? normalized_ : raw_, text, out);
}

void AddedVocabulary::FindSplitsWith(const Matcher& m, std::string_view s,
                                     std::vector<TextSplit>* out) const {
  out->clear();
  size_t start_offset = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (!m.first_byte[static_cast<unsigned char>(s[i])]) {
      ++i;
      continue;
    }
    // Leftmost-longest: the longest pattern starting at the first position that has one.
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < s.size(); ++j) {
      auto it = m.nodes[node].next.find(static_cast<unsigned char>(s[j]));
      if (it == m.nodes[node].next.end()) break;
      node = it->second;
      if (m.nodes[node].token >= 0) {
        best = m.nodes[node].token;
        best_end = j + 1;
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const size_t hit_start = i;
    i = best_end;
    const AddedToken& t = tokens_[best];
    size_t start = hit_start, stop = best_end;
    if (t.single_word) {
      bool start_space = start == 0 || !EndsWithWord(s.substr(0, start));
      bool stop_space = stop == s.size() || !StartsWithWord(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      size_t newstart = start;
      while (newstart > 0) {
        size_t b = newstart - 1;
        while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
        char32_t c;
        Utf8Decode(s, b, &c);
        if (!IsWhitespace(c)) break;
        newstart = b;
      }
      start = std::max(newstart, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        char32_t c;
        int n = Utf8Decode(s, stop, &c);
        if (!IsWhitespace(c)) break;
        stop += n;
      }
    }
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, t.id});
    start_offset = stop;
  }
  if (start_offset != s.size()) out->push_back({start_offset, s.size(), -1});
}

void AddedVocabulary::SplitOn(const Matcher& m, PreTokenizedString::Piece& piece,
                              std::vector<PreTokenizedString::Piece>* out) const {
  std::vector<TextSplit> splits;
  FindSplitsWith(m, piece.text.get(), &splits);
  for (const TextSplit& sp : splits) {
    PreTokenizedString::Piece p;
    p.text = piece.text.Slice(sp.start, sp.end);
    if (p.text.empty()) continue;
    if (sp.id >= 0) {
      p.has_tokens = true;
      p.tokens.push_back(Token{sp.id, p.text.get(), Span{0, static_cast<uint32_t>(p.text.size())}});
    }
    out->push_back(std::move(p));
  }
}

void AddedVocabulary::ExtractAndNormalize(std::string_view text, const Normalizer* normalizer,
                                          PreTokenizedString* out) const {
  out->pieces.clear();
  PreTokenizedString::Piece whole;
  whole.text = NormalizedString(text);
  std::vector<PreTokenizedString::Piece> first;
  if (raw_.empty()) {
    if (!whole.text.empty()) first.push_back(std::move(whole));
  } else {
    SplitOn(raw_, whole, &first);
  }
  for (auto& piece : first) {
    if (piece.has_tokens) {
      out->pieces.push_back(std::move(piece));
      continue;
    }
    if (normalizer != nullptr) normalizer->Normalize(&piece.text);
    if (piece.text.empty()) continue;
    if (normalized_.empty()) {
      out->pieces.push_back(std::move(piece));
    } else {
      SplitOn(normalized_, piece, &out->pieces);
    }
  }
}

}  // namespace tgis::tok

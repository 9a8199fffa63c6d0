#include "tokenizer/src/normalized_string.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>

#include "tokenizer/src/unicode.h"

namespace tgis::tok {

NormalizedString::NormalizedString(std::string_view text, size_t shift)
    : normalized_(text), original_shift_(shift), original_len_(text.size()) {
  align_.resize(text.size());
  size_t i = 0;
  while (i < text.size()) {
    size_t n = Utf8SeqLen(static_cast<unsigned char>(text[i]));
    if (i + n > text.size()) n = text.size() - i;
    Span sp{static_cast<uint32_t>(i), static_cast<uint32_t>(i + n)};
    for (size_t k = 0; k < n; ++k) align_[i + k] = sp;
    i += n;
  }
}

Span NormalizedString::ToOriginal(size_t s, size_t e) const {
  if (s == e) return Span{static_cast<uint32_t>(s), static_cast<uint32_t>(e)};
  if (normalized_.empty()) return Span{0, static_cast<uint32_t>(original_len_)};
  return Span{align_[s].start, align_[e - 1].end};
}

void NormalizedString::TransformRange(size_t n_start, size_t n_end,
                                      const std::vector<CharChange>& dest, size_t initial_offset) {
  // Walk the replaced chars in lockstep with dest, as HF does, to know which old alignment
  // each new char inherits.
  size_t cursor = n_start;  // byte position of the next old char not yet consumed
  auto take_char = [&]() -> size_t {
    if (cursor >= n_end) return 0;
    size_t len = Utf8SeqLen(static_cast<unsigned char>(normalized_[cursor]));
    cursor += len;
    return len;
  };
  for (size_t k = 0; k < initial_offset; ++k) take_char();

  std::string out;
  std::vector<Span> out_align;
  out.reserve(n_end - n_start + dest.size());
  out_align.reserve(n_end - n_start + dest.size());
  for (const CharChange& cc : dest) {
    size_t idx = cursor;
    Span a;
    if (cc.change > 0) {
      a = idx < 1 ? Span{0, 0} : align_[idx - 1];
    } else {
      a = align_[idx];
      take_char();
      for (int r = 0; r < -cc.change; ++r) take_char();
    }
    size_t before = out.size();
    AppendUtf8(cc.ch, &out);
    out_align.insert(out_align.end(), out.size() - before, a);
  }
  normalized_.replace(n_start, n_end - n_start, out);
  align_.erase(align_.begin() + n_start, align_.begin() + n_end);
  align_.insert(align_.begin() + n_start, out_align.begin(), out_align.end());
}

NormalizedString NormalizedString::Slice(size_t n_start, size_t n_end) const {
  Span orig = ToOriginal(n_start, n_end);
  NormalizedString r;
  r.normalized_ = normalized_.substr(n_start, n_end - n_start);
  r.align_.assign(align_.begin() + n_start, align_.begin() + n_end);
  const uint32_t shift = orig.start;
  for (Span& sp : r.align_) {
    sp.start -= shift;
    sp.end -= shift;
  }
  r.original_shift_ = original_shift_ + orig.start;
  r.original_len_ = orig.end - orig.start;
  return r;
}

namespace {
uint8_t CombiningClass(char32_t c) {
  return static_cast<uint8_t>(u_getCombiningClass(static_cast<UChar32>(c)));
}
// The primary composite of a + b, or 0.
char32_t ComposePair(char32_t a, char32_t b) {
  UErrorCode err = U_ZERO_ERROR;
  static const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(err);
  UChar32 c = nfc->composePair(static_cast<UChar32>(a), static_cast<UChar32>(b));
  return c < 0 ? 0 : static_cast<char32_t>(c);
}

std::vector<CharChange> Chars(std::string_view s) {
  std::vector<CharChange> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    char32_t c;
    i += Utf8Decode(s, i, &c);
    out.push_back({c, 0});
  }
  return out;
}
}  // namespace

void NormalizedString::Prepend(std::string_view s) {
  if (normalized_.empty() || s.empty()) return;
  char32_t next;
  int next_len = Utf8Decode(normalized_, 0, &next);
  std::vector<CharChange> dest = Chars(s);
  for (size_t i = 1; i < dest.size(); ++i) dest[i].change = 1;
  dest.push_back({next, 1});
  TransformRange(0, next_len, dest, 0);
}

void NormalizedString::Append(std::string_view s) {
  if (normalized_.empty() || s.empty()) return;
  size_t b = normalized_.size() - 1;
  while (b > 0 && (static_cast<unsigned char>(normalized_[b]) & 0xC0) == 0x80) --b;
  char32_t prev;
  Utf8Decode(normalized_, b, &prev);
  std::vector<CharChange> dest{{prev, 0}};
  for (CharChange c : Chars(s)) dest.push_back({c.ch, 1});
  TransformRange(b, normalized_.size(), dest, 0);
}

void NormalizedString::Filter(const std::function<bool(char32_t)>& keep) {
  std::vector<CharChange> dest;
  int removed = 0;
  size_t removed_start = 0;
  bool have_last = false;
  char32_t last = 0;
  for (CharChange c : Chars(normalized_)) {
    if (keep(c.ch)) {
      if (have_last) {
        dest.push_back({last, -removed});
      } else {
        removed_start = removed;
      }
      last = c.ch;
      have_last = true;
      removed = 0;
    } else {
      ++removed;
    }
  }
  if (have_last) dest.push_back({last, -removed});
  if (!have_last) removed_start = removed;
  Transform(dest, removed_start);
}

void NormalizedString::Map(const std::function<char32_t(char32_t)>& map) {
  std::vector<CharChange> dest = Chars(normalized_);
  for (CharChange& c : dest) c.ch = map(c.ch);
  Transform(dest, 0);
}

void NormalizedString::Lowercase() {
  std::vector<CharChange> dest;
  for (CharChange c : Chars(normalized_)) {
    // Full lowercase mapping of U+0130 is two chars; ICU's simple mapping covers the rest.
    if (c.ch == 0x130) {
      dest.push_back({U'i', 0});
      dest.push_back({0x307, 1});
    } else {
      dest.push_back({static_cast<char32_t>(u_tolower(static_cast<UChar32>(c.ch))), 0});
    }
  }
  Transform(dest, 0);
}

void NormalizedString::Strip(bool left, bool right) {
  std::vector<CharChange> chars = Chars(normalized_);
  size_t leading = 0, trailing = 0;
  if (left) {
    while (leading < chars.size() && IsWhitespace(chars[leading].ch)) ++leading;
  }
  if (right) {
    while (trailing < chars.size() - leading &&
           IsWhitespace(chars[chars.size() - 1 - trailing].ch)) {
      ++trailing;
    }
  }
  if (leading == 0 && trailing == 0) return;
  std::vector<CharChange> dest;
  const size_t n = chars.size();
  for (size_t i = 0; i < n; ++i) {
    if (i < leading || i >= n - trailing) continue;
    dest.push_back({chars[i].ch, i == n - trailing - 1 ? -static_cast<int>(trailing) : 0});
  }
  Transform(dest, leading);
}

void NormalizedString::Normalize(int form_int) {
  auto form = static_cast<NormalForm>(form_int);
  if (IsNormalized(normalized_, form)) return;
  // Reproduce the (char, change) stream of the unicode-normalization crate HF uses, so that
  // alignments agree: decompose char by char (extra chars are insertions), reorder combining
  // marks by class (changes travel with their chars), then compose, a starter absorbing each
  // char composed into it.
  const bool compose = form == NormalForm::kNfc || form == NormalForm::kNfkc;
  const NormalForm decomposed_form =
      form == NormalForm::kNfkc || form == NormalForm::kNfkd ? NormalForm::kNfkd : NormalForm::kNfd;
  struct Item {
    char32_t ch;
    int change;
    uint8_t ccc;
  };
  std::vector<Item> items;
  items.reserve(normalized_.size());
  for (CharChange c : Chars(normalized_)) {
    std::string one = ToUtf8(c.ch);
    std::string dec =
        IsNormalized(one, decomposed_form) ? one : NormalizeUnicode(one, decomposed_form);
    bool first = true;
    for (CharChange d : Chars(dec)) {
      items.push_back({d.ch, first ? 0 : 1, CombiningClass(d.ch)});
      first = false;
    }
  }
  for (size_t i = 0; i < items.size();) {
    if (items[i].ccc == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < items.size() && items[j].ccc != 0) ++j;
    std::stable_sort(items.begin() + i, items.begin() + j,
                     [](const Item& a, const Item& b) { return a.ccc < b.ccc; });
    i = j;
  }
  std::vector<CharChange> dest;
  dest.reserve(items.size());
  if (!compose) {
    for (const Item& it : items) dest.push_back({it.ch, it.change});
  } else {
    long starter = -1;  // index in dest of the last starter
    int last_ccc = -1;  // ccc of the last char appended after the starter (-1: none)
    for (const Item& it : items) {
      if (starter >= 0) {
        const bool adjacent = last_ccc == -1;
        const bool unblocked = adjacent || (last_ccc != 0 && last_ccc < it.ccc);
        if (unblocked) {
          char32_t composite = ComposePair(dest[starter].ch, it.ch);
          if (composite != 0) {
            dest[starter].ch = composite;
            dest[starter].change += it.change - 1;
            continue;
          }
        }
      }
      dest.push_back({it.ch, it.change});
      if (it.ccc == 0) {
        starter = static_cast<long>(dest.size()) - 1;
        last_ccc = -1;
      } else {
        last_ccc = it.ccc;
      }
    }
  }
  Transform(dest, 0);
}

void NormalizedString::Replace(const std::vector<MatchSpan>& matches, std::string_view content) {
  // One pass over the string (a replace per match, each moving the rest of the string, was
  // quadratic: 20k spaces of a Metaspace tokenizer took 0.4 s). As TransformRange does for an
  // insertion after removed chars, every byte of the new content inherits the alignment of
  // the last byte it replaces.
  std::string out;
  std::vector<Span> out_align;
  out.reserve(normalized_.size());
  out_align.reserve(align_.size());
  size_t pos = 0;
  for (const MatchSpan& m : matches) {
    if (!m.is_match) continue;
    out.append(normalized_, pos, m.start - pos);
    out_align.insert(out_align.end(), align_.begin() + pos, align_.begin() + m.start);
    const Span a = m.end < 1 ? Span{0, 0} : align_[m.end - 1];
    out.append(content);
    out_align.insert(out_align.end(), content.size(), a);
    pos = m.end;
  }
  if (pos == 0 && out.empty()) return;  // no match
  out.append(normalized_, pos, std::string::npos);
  out_align.insert(out_align.end(), align_.begin() + pos, align_.end());
  normalized_ = std::move(out);
  align_ = std::move(out_align);
}

std::vector<std::pair<size_t, size_t>> SplitRanges(const std::vector<MatchSpan>& matches,
                                                   SplitBehavior behavior) {
  struct Piece {
    size_t s, e;
    bool remove;
  };
  std::vector<Piece> pieces;
  pieces.reserve(matches.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& m : matches) pieces.push_back({m.start, m.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const auto& m : matches) pieces.push_back({m.start, m.end, m.is_match});
      break;
    case SplitBehavior::kContiguous: {
      bool prev = false;
      for (const auto& m : matches) {
        if (m.is_match == prev && !pieces.empty()) {
          pieces.back().e = m.end;
        } else {
          pieces.push_back({m.start, m.end, false});
        }
        prev = m.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool prev = false;
      for (const auto& m : matches) {
        if (m.is_match && !prev && !pieces.empty()) {
          pieces.back().e = m.end;
        } else {
          pieces.push_back({m.start, m.end, false});
        }
        prev = m.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->is_match && !prev && !pieces.empty()) {
          pieces.back().s = it->start;
        } else {
          pieces.push_back({it->start, it->end, false});
        }
        prev = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
  }
  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(pieces.size());
  for (const Piece& p : pieces) {
    if (!p.remove) out.emplace_back(p.s, p.e);
  }
  return out;
}

std::vector<NormalizedString> NormalizedString::Split(const std::vector<MatchSpan>& matches,
                                                      SplitBehavior behavior) const {
  std::vector<NormalizedString> out;
  for (auto [s, e] : SplitRanges(matches, behavior)) out.push_back(Slice(s, e));
  return out;
}

std::vector<MatchSpan> MatchCharPredicate(std::string_view s,
                                          const std::function<bool(char32_t)>& pred) {
  std::vector<MatchSpan> out;
  if (s.empty()) {
    out.push_back({0, 0, false});
    return out;
  }
  size_t last_offset = 0, last_seen = 0;
  for (size_t i = 0; i < s.size();) {
    char32_t c;
    int n = Utf8Decode(s, i, &c);
    last_seen = i + n;
    if (pred(c)) {
      if (last_offset < i) out.push_back({last_offset, i, false});
      out.push_back({i, i + n, true});
      last_offset = i + n;
    }
    i += n;
  }
  if (last_seen > last_offset) out.push_back({last_offset, last_seen, false});
  return out;
}

std::vector<MatchSpan> MatchLiteral(std::string_view s, std::string_view literal) {
  std::vector<MatchSpan> out;
  if (literal.empty() || s.empty()) {
    out.push_back({0, s.size(), false});
    return out;
  }
  size_t prev = 0;
  for (size_t pos = s.find(literal); pos != std::string_view::npos;
       pos = s.find(literal, pos + literal.size())) {
    if (prev != pos) out.push_back({prev, pos, false});
    out.push_back({pos, pos + literal.size(), true});
    prev = pos + literal.size();
  }
  if (prev != s.size()) out.push_back({prev, s.size(), false});
  return out;
}

}  // namespace tgis::tok

// A piece of text under normalization that remembers, for every byte, which bytes of the
// original input it came from. This is what lets us report offsets into the user's text after
// normalizers and pre-tokenizers rewrote it (the same model as HF tokenizers, so that offsets
// agree with it to the byte).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tgis::tok {

struct Span {
  uint32_t start = 0;
  uint32_t end = 0;
  bool operator==(const Span&) const = default;
};

// One edit for NormalizedString::Transform: the new char and how it relates to the old text:
// 0 replaces one old char, +1 is inserted, -n replaces one old char and removes n after it.
struct CharChange {
  char32_t ch;
  int change;
};

// A (start, end) byte range of a match, and whether it is a match (true) or the text between.
struct MatchSpan {
  size_t start;
  size_t end;
  bool is_match;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class NormalizedString {
 public:
  NormalizedString() = default;
  // A fresh string whose original is `text`, placed at `shift` bytes into the full input.
  explicit NormalizedString(std::string_view text, size_t shift = 0);

  const std::string& get() const { return normalized_; }
  bool empty() const { return normalized_.empty(); }
  size_t size() const { return normalized_.size(); }
  size_t original_shift() const { return original_shift_; }
  size_t original_len() const { return original_len_; }
  const std::vector<Span>& alignments() const { return align_; }

  // Original byte range (relative to this string's original) of normalized bytes [s, e).
  Span ToOriginal(size_t s, size_t e) const;

  // Replaces normalized bytes [n_start, n_end) with the chars of `dest`; `initial_offset` old
  // chars at the start of the range are dropped.
  void TransformRange(size_t n_start, size_t n_end, const std::vector<CharChange>& dest,
                      size_t initial_offset);
  void Transform(const std::vector<CharChange>& dest, size_t initial_offset) {
    TransformRange(0, normalized_.size(), dest, initial_offset);
  }

  NormalizedString Slice(size_t n_start, size_t n_end) const;

  void Prepend(std::string_view s);
  void Append(std::string_view s);
  void Filter(const std::function<bool(char32_t)>& keep);
  void Map(const std::function<char32_t(char32_t)>& map);
  void Lowercase();
  void Strip(bool left, bool right);
  void Normalize(int form);  // NormalForm as int, to keep unicode.h out of this header
  // Replaces every match with `content`.
  void Replace(const std::vector<MatchSpan>& matches, std::string_view content);
  // Splits into pieces according to matches (which cover the whole string) and behavior.
  std::vector<NormalizedString> Split(const std::vector<MatchSpan>& matches,
                                      SplitBehavior behavior) const;

 private:
  std::string normalized_;
  std::vector<Span> align_;
  size_t original_shift_ = 0;
  size_t original_len_ = 0;
};

// The [start, end) pieces that `behavior` keeps from matches covering a string.
std::vector<std::pair<size_t, size_t>> SplitRanges(const std::vector<MatchSpan>& matches,
                                                   SplitBehavior behavior);

// Pattern matchers producing MatchSpans that cover the whole input (HF's Pattern contract).
std::vector<MatchSpan> MatchCharPredicate(std::string_view s,
                                          const std::function<bool(char32_t)>& pred);
std::vector<MatchSpan> MatchLiteral(std::string_view s, std::string_view literal);

}  // namespace tgis::tok

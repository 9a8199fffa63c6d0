// The parsed form of a pattern: sets of Unicode code points combined by concatenation,
// alternation and bounded or unbounded repetition (all a regular language needs).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::grammar {

struct CodeRange {
  char32_t lo, hi;  // inclusive
};
// Sorted, disjoint, non-adjacent ranges.
using CharSet = std::vector<CodeRange>;

inline constexpr char32_t kMaxCodePoint = 0x10FFFF;

CharSet Normalized(CharSet set);
// Every code point not in `set` (surrogates are dropped later: UTF-8 cannot carry them).
CharSet Complement(const CharSet& set);
CharSet Union(CharSet a, const CharSet& b);

struct RegexNode {
  // kRule and kJump come from grammars: a rule's instance (its one child), and a reference to
  // the instance of an enclosing rule `rule` in the position where nothing follows it in that
  // rule (tail recursion, a loop back to the rule's start: still a regular language).
  enum Kind { kEmpty, kSet, kConcat, kAlt, kRepeat, kRule, kJump };
  Kind kind = kEmpty;
  CharSet set;                      // kSet
  std::vector<RegexNode> children;  // kConcat, kAlt; kRepeat, kRule: one
  int32_t min = 0, max = -1;        // kRepeat; max -1: unbounded
  int32_t rule = -1;                // kRule, kJump

  static RegexNode Set(CharSet s) {
    RegexNode n;
    n.kind = kSet;
    n.set = std::move(s);
    return n;
  }
  static RegexNode Literal(std::u32string_view text);
};

// The most a {m,n} counts (each copy of its operand is expanded).
inline constexpr int64_t kMaxRepeatCount = 10000;
// A repetition count's decimal digits at text[*pos] (*pos moves past them; the value saturates
// at 2^40); false when there is no digit there.
bool ReadCount(std::u32string_view text, size_t* pos, int64_t* value);

// Python `re` syntax (see grammar.h for what is supported).
absl::StatusOr<RegexNode> ParseRegex(std::string_view pattern);

struct ByteDfa;
// The minimal automaton of a parsed language (byte_dfa.cc).
absl::StatusOr<ByteDfa> CompileNode(const RegexNode& root);

}  // namespace tgis::grammar

// A recursive-descent parser of Python `re` patterns into RegexNode. Errors name the position
// (in characters, as Python's re.error does) and what is wrong or not supported.
#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "grammar/src/regex_ast.h"
#include "grammar/src/utf8.h"

namespace tgis::grammar {

CharSet Normalized(CharSet set) {
  std::sort(set.begin(), set.end(),
            [](const CodeRange& a, const CodeRange& b) { return a.lo < b.lo; });
  CharSet out;
  for (const CodeRange& r : set) {
    if (!out.empty() && r.lo <= out.back().hi + 1) {
      out.back().hi = std::max(out.back().hi, r.hi);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

CharSet Complement(const CharSet& set) {
  CharSet out;
  char32_t next = 0;
  for (const CodeRange& r : Normalized(set)) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return out;
}

CharSet Union(CharSet a, const CharSet& b) {
  a.insert(a.end(), b.begin(), b.end());
  return Normalized(std::move(a));
}

bool ReadCount(std::u32string_view text, size_t* pos, int64_t* value) {
  const size_t start = *pos;
  *value = 0;
  for (; *pos < text.size() && text[*pos] >= '0' && text[*pos] <= '9'; ++*pos) {
    *value = std::min<int64_t>(*value * 10 + (text[*pos] - '0'), int64_t{1} << 40);
  }
  return *pos > start;
}

RegexNode RegexNode::Literal(std::u32string_view text) {
  RegexNode n;
  n.kind = kConcat;
  for (char32_t c : text) n.children.push_back(Set({{c, c}}));
  return n;
}

namespace {

// \d \w \s with ASCII meanings (xgrammar's, which vLLM uses by default; Python's str patterns
// would take every Unicode digit, letter and space).
const CharSet kDigit = {{'0', '9'}};
const CharSet kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const CharSet kSpace = {{'\t', '\r'}, {' ', ' '}};

class Parser {
 public:
  explicit Parser(std::u32string text) : s_(std::move(text)) {}

  absl::StatusOr<RegexNode> Parse() {
    // The start of the text: the whole text is matched, so an anchor there changes nothing.
    if (Peek() == '^') {
      pos_ = 1;
    } else if (Peek() == '\\' && Peek(1) == 'A') {
      pos_ = 2;
    }
    absl::StatusOr<RegexNode> node = ParseAlternation();
    if (!node.ok()) return node;
    if (pos_ < s_.size()) return Error("unbalanced parenthesis");
    return node;
  }

 private:
  bool AtEnd() const { return pos_ >= s_.size(); }
  char32_t Peek(size_t ahead = 0) const {
    return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : char32_t{0};
  }
  absl::Status Error(absl::string_view what) const { return ErrorAt(what, pos_); }
  absl::Status ErrorAt(absl::string_view what, size_t at) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at position ", at));
  }
  absl::Status Unsupported(absl::string_view what, size_t at) const {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " (at position ", at, ") cannot be used in guided decoding"));
  }

  absl::StatusOr<RegexNode> ParseAlternation() {
    RegexNode alt;
    alt.kind = RegexNode::kAlt;
    while (true) {
      absl::StatusOr<RegexNode> branch = ParseConcatenation();
      if (!branch.ok()) return branch;
      alt.children.push_back(*std::move(branch));
      if (Peek() != '|' || AtEnd()) break;
      ++pos_;
    }
    if (alt.children.size() == 1) return std::move(alt.children[0]);
    return alt;
  }

  absl::StatusOr<RegexNode> ParseConcatenation() {
    RegexNode seq;
    seq.kind = RegexNode::kConcat;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      const size_t at = pos_;
      // The ends of the text: the whole text is matched, so an anchor there changes nothing.
      if ((Peek() == '$' && pos_ + 1 == s_.size()) ||
          (Peek() == '\\' && Peek(1) == 'Z' && pos_ + 2 == s_.size())) {
        pos_ = s_.size();
        break;
      }
      if (Peek() == '$' || Peek() == '^' ||
          (Peek() == '\\' && (Peek(1) == 'A' || Peek(1) == 'Z'))) {
        return Unsupported("an anchor other than at the start or the end of the pattern", at);
      }
      absl::StatusOr<RegexNode> atom = ParseAtom();
      if (!atom.ok()) return atom;
      absl::StatusOr<RegexNode> repeated = ParseQuantifiers(*std::move(atom));
      if (!repeated.ok()) return repeated;
      seq.children.push_back(*std::move(repeated));
    }
    if (seq.children.size() == 1) return std::move(seq.children[0]);
    if (seq.children.empty()) seq.kind = RegexNode::kEmpty;
    return seq;
  }

  // {m}, {m,}, {,n}, {m,n} at pos_ (on '{'); nothing when the text there is not one (Python
  // then reads the '{' as a literal).
  std::optional<std::pair<int64_t, int64_t>> Braces(size_t* end) const {
    size_t p = pos_ + 1;
    int64_t lo = 0, hi = -1;
    const bool has_lo = ReadCount(s_, &p, &lo);
    if (p < s_.size() && s_[p] == '}') {
      if (!has_lo) return std::nullopt;
      *end = p + 1;
      return std::pair{lo, lo};
    }
    if (p >= s_.size() || s_[p] != ',') return std::nullopt;
    ++p;
    int64_t upper = 0;
    if (ReadCount(s_, &p, &upper)) hi = upper;
    if (p >= s_.size() || s_[p] != '}') return std::nullopt;
    *end = p + 1;
    return std::pair{lo, hi};
  }

  absl::StatusOr<RegexNode> ParseQuantifiers(RegexNode atom) {
    bool repeated = false;
    while (!AtEnd()) {
      const size_t at = pos_;
      int64_t lo = 0, hi = -1;
      const char32_t c = Peek();
      size_t end = pos_ + 1;
      if (c == '*') {
        lo = 0;
      } else if (c == '+') {
        lo = 1;
      } else if (c == '?') {
        lo = 0;
        hi = 1;
      } else if (c == '{') {
        auto braces = Braces(&end);
        if (!braces) break;
        lo = braces->first;
        hi = braces->second;
        if (hi >= 0 && lo > hi) return ErrorAt("min repeat greater than max repeat", at + 1);
        if (lo > kMaxRepeatCount || hi > kMaxRepeatCount) {
          return ErrorAt(absl::StrCat("a repeat count above ", kMaxRepeatCount), at + 1);
        }
      } else {
        break;
      }
      if (repeated) return ErrorAt("multiple repeat", at);
      repeated = true;
      pos_ = end;
      if (Peek() == '?') {
        ++pos_;  // lazy: the same language
      } else if (Peek() == '+') {
        return Unsupported("a possessive quantifier", pos_);
      }
      RegexNode r;
      r.kind = RegexNode::kRepeat;
      r.min = static_cast<int32_t>(lo);
      r.max = static_cast<int32_t>(hi);
      r.children.push_back(std::move(atom));
      atom = std::move(r);
    }
    return atom;
  }

  absl::StatusOr<RegexNode> ParseAtom() {
    const size_t at = pos_;
    const char32_t c = Peek();
    switch (c) {
      case '(':
        return ParseGroup();
      case '[':
        return ParseClass();
      case '.':
        ++pos_;
        return RegexNode::Set(Complement({{'\n', '\n'}}));
      case '*':
      case '+':
      case '?':
        return ErrorAt("nothing to repeat", at);
      case '{': {
        size_t end = 0;
        if (Braces(&end)) return ErrorAt("nothing to repeat", at);
        ++pos_;
        return RegexNode::Set({{c, c}});
      }
      case '\\': {
        absl::StatusOr<CharSet> set = ParseEscape(/*in_class=*/false);
        if (!set.ok()) return set.status();
        return RegexNode::Set(*std::move(set));
      }
      default:
        ++pos_;
        return RegexNode::Set({{c, c}});
    }
  }

  absl::StatusOr<RegexNode> ParseGroup() {
    const size_t open = pos_;
    // Python's own limit is its recursion limit; ours keeps the parser's stack small.
    constexpr int kMaxNesting = 200;
    if (++nesting_ > kMaxNesting) return ErrorAt("groups nested too deeply", open);
    absl::StatusOr<RegexNode> group = ParseGroupBody();
    --nesting_;
    return group;
  }

  absl::StatusOr<RegexNode> ParseGroupBody() {
    const size_t open = pos_;
    ++pos_;  // '('
    if (Peek() == '?') {
      const char32_t kind = Peek(1);
      if (kind == ':') {
        pos_ += 2;
      } else if (kind == 'P' && Peek(2) == '<') {
        pos_ += 3;
        const size_t name_at = pos_;
        while (!AtEnd() && Peek() != '>') ++pos_;
        if (AtEnd()) return ErrorAt("missing >, unterminated name", name_at);
        if (pos_ == name_at) return ErrorAt("missing group name", name_at);
        ++pos_;
      } else if (kind == 'P' && Peek(2) == '=') {
        return Unsupported("a backreference", open);
      } else if (kind == '=' || kind == '!' ||
                 (kind == '<' && (Peek(2) == '=' || Peek(2) == '!'))) {
        return Unsupported("a lookaround assertion", open);
      } else if (kind == '#') {
        while (!AtEnd() && Peek() != ')') ++pos_;
        if (AtEnd()) return ErrorAt("missing ), unterminated comment", open);
        ++pos_;
        return RegexNode{};
      } else if (kind == '(') {
        return Unsupported("a conditional group", open);
      } else if (kind == '>') {
        return Unsupported("an atomic group", open);
      } else {
        return Unsupported("an inline flag or group extension", open);
      }
    }
    absl::StatusOr<RegexNode> inner = ParseAlternation();
    if (!inner.ok()) return inner;
    if (Peek() != ')' || AtEnd()) return ErrorAt("missing ), unterminated subpattern", open);
    ++pos_;
    return inner;
  }

  absl::StatusOr<RegexNode> ParseClass() {
    const size_t open = pos_;
    ++pos_;  // '['
    bool negated = false;
    if (Peek() == '^' && !AtEnd()) {
      negated = true;
      ++pos_;
    }
    CharSet set;
    bool first = true;
    while (true) {
      if (AtEnd()) return ErrorAt("unterminated character set", open);
      if (Peek() == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      const size_t item_at = pos_;
      absl::StatusOr<CharSet> lo = ClassItem();
      if (!lo.ok()) return lo.status();
      if (Peek() == '-' && Peek(1) != ']' && pos_ + 1 < s_.size()) {
        ++pos_;
        absl::StatusOr<CharSet> hi = ClassItem();
        if (!hi.ok()) return hi.status();
        if (lo->size() != 1 || lo->front().lo != lo->front().hi || hi->size() != 1 ||
            hi->front().lo != hi->front().hi) {
          return ErrorAt("bad character range", item_at);
        }
        if (hi->front().lo < lo->front().lo) return ErrorAt("bad character range", item_at);
        set.push_back({lo->front().lo, hi->front().lo});
      } else {
        set.insert(set.end(), lo->begin(), lo->end());
      }
    }
    set = Normalized(std::move(set));
    return RegexNode::Set(negated ? Complement(set) : set);
  }

  absl::StatusOr<CharSet> ClassItem() {
    if (Peek() == '\\') return ParseEscape(/*in_class=*/true);
    const char32_t c = Peek();
    ++pos_;
    return CharSet{{c, c}};
  }

  // At a backslash: the set it stands for (one character for a plain escape).
  absl::StatusOr<CharSet> ParseEscape(bool in_class) {
    const size_t at = pos_;
    ++pos_;
    if (AtEnd()) return ErrorAt("bad escape (end of pattern)", at);
    const char32_t c = Peek();
    ++pos_;
    auto one = [](char32_t x) { return CharSet{{x, x}}; };
    auto hex = [&](int digits) -> absl::StatusOr<CharSet> {
      std::optional<char32_t> value = ReadHexEscape(s_, &pos_, digits);
      if (!value) {
        return ErrorAt(absl::StrCat("incomplete or out-of-range escape \\",
                                    std::string(1, static_cast<char>(c))),
                       at);
      }
      return one(*value);
    };
    switch (c) {
      case 'd':
        return kDigit;
      case 'D':
        return Complement(kDigit);
      case 'w':
        return kWord;
      case 'W':
        return Complement(kWord);
      case 's':
        return kSpace;
      case 'S':
        return Complement(kSpace);
      case 'n':
        return one('\n');
      case 't':
        return one('\t');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case 'a':
        return one('\a');
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      case 'U':
        return hex(8);
      case 'b':
        if (in_class) return one('\b');
        return Unsupported("a word boundary", at);
      case 'B':
        return Unsupported("a word boundary", at);
      case 'N':
        return Unsupported("a named character escape", at);
      case '0': {
        char32_t value = 0;
        for (int i = 0; i < 2 && Peek() >= '0' && Peek() <= '7' && !AtEnd(); ++i) {
          value = value * 8 + (Peek() - '0');
          ++pos_;
        }
        return one(value);
      }
      default:
        break;
    }
    if (c >= '1' && c <= '9') {
      // Three octal digits are a character; anything else is a group reference.
      if (c <= '3' && Peek() >= '0' && Peek() <= '7' && Peek(1) >= '0' && Peek(1) <= '7' &&
          pos_ + 1 < s_.size()) {
        const char32_t value = (c - '0') * 64 + (Peek() - '0') * 8 + (Peek(1) - '0');
        pos_ += 2;
        return one(value);
      }
      return Unsupported("a backreference", at);
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      return ErrorAt(absl::StrCat("bad escape \\", std::string(1, static_cast<char>(c))), at);
    }
    return one(c);
  }

  std::u32string s_;
  size_t pos_ = 0;
  int nesting_ = 0;
};

}  // namespace

absl::StatusOr<RegexNode> ParseRegex(std::string_view pattern) {
  std::optional<std::u32string> text = DecodeUtf8(pattern);
  if (!text) return absl::InvalidArgumentError("the pattern is not valid UTF-8");
  return Parser(*std::move(text)).Parse();
}

}  // namespace tgis::grammar

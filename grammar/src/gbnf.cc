// GBNF grammars (llama.cpp's EBNF dialect, which xgrammar reads too: vLLM's `grammar`) served
// when their language is regular: every rule reference is inlined from `root`, right recursion
// becomes a loop, and any other recursion (a context-free language, such as JSON's) is refused
// by name.
//
//   root ::= answer ("," ws answer)*        # a comment
//   answer ::= "yes" | "no" | [0-9]{1,3}
//   ws ::= [ \t\n]*
//
// Terminals: "literals" and [character classes] (ranges, ^, escapes \n \t \r \\ \" \] \xHH
// \uHHHH \UHHHHHHHH), `.` (any character); grouping, alternation, postfix * + ? {m} {m,}
// {m,n}. A rule runs to the end of its line, or on while parentheses are open.
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grammar/grammar.h"
#include "grammar/src/regex_ast.h"
#include "grammar/src/utf8.h"

namespace tgis::grammar {
namespace {

// A rule body: RegexNode's kinds, plus references to rules (kind kEmpty with `ref` set).
struct Expr {
  RegexNode node;              // sets, and the structure of the children below
  std::vector<Expr> children;  // kConcat, kAlt, kRepeat
  std::string ref;             // a rule reference when not empty
};

class GbnfParser {
 public:
  explicit GbnfParser(std::u32string text) : s_(std::move(text)) {}

  absl::Status Parse(std::map<std::string, Expr>* rules) {
    while (true) {
      SkipSpace(/*newlines=*/true);
      if (AtEnd()) break;
      const size_t at = pos_;
      std::string name = Name();
      if (name.empty()) return Error("expected a rule name", at);
      SkipSpace(false);
      if (!Take(U"::=")) return Error(absl::StrCat("expected ::= after ", name), pos_);
      SkipSpace(true);
      absl::StatusOr<Expr> body = Alternatives(/*nested=*/false);
      if (!body.ok()) return body.status();
      if (rules->count(name)) return Error(absl::StrCat("rule ", name, " is defined twice"), at);
      (*rules)[name] = *std::move(body);
      SkipSpace(false);
      if (!AtEnd() && Peek() != '\n' && Peek() != '\r') {
        return Error("expected the end of the rule", pos_);
      }
    }
    return absl::OkStatus();
  }

 private:
  bool AtEnd() const { return pos_ >= s_.size(); }
  char32_t Peek(size_t ahead = 0) const {
    return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : char32_t{0};
  }
  bool Take(std::u32string_view word) {
    if (s_.compare(pos_, word.size(), word) != 0) return false;
    pos_ += word.size();
    return true;
  }
  absl::Status Error(absl::string_view what, size_t at) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("grammar: ", what, " at line ", line, " column ", column));
  }
  static bool NameChar(char32_t c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  }
  std::string Name() {
    std::string name;
    while (!AtEnd() && NameChar(Peek())) name.push_back(static_cast<char>(s_[pos_++]));
    return name;
  }
  // Spaces, tabs and comments; newlines too when `newlines` (inside parentheses, after ::=).
  void SkipSpace(bool newlines) {
    while (!AtEnd()) {
      const char32_t c = Peek();
      if (c == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  absl::StatusOr<Expr> Alternatives(bool nested) {
    Expr alt;
    alt.node.kind = RegexNode::kAlt;
    while (true) {
      absl::StatusOr<Expr> seq = Sequence(nested);
      if (!seq.ok()) return seq;
      alt.children.push_back(*std::move(seq));
      SkipSpace(nested);
      if (Peek() != '|' || AtEnd()) break;
      ++pos_;
      SkipSpace(true);
    }
    if (alt.children.size() == 1) return std::move(alt.children[0]);
    return alt;
  }

  absl::StatusOr<Expr> Sequence(bool nested) {
    Expr seq;
    seq.node.kind = RegexNode::kConcat;
    while (true) {
      SkipSpace(nested);
      const char32_t c = Peek();
      if (AtEnd() || c == '|' || c == ')' || c == '\n' || c == '\r') break;
      // The next rule's definition starts a line: `name ::=` (seen when not nested).
      if (!nested && NameChar(c)) {
        size_t p = pos_;
        while (p < s_.size() && NameChar(s_[p])) ++p;
        while (p < s_.size() && (s_[p] == ' ' || s_[p] == '\t')) ++p;
        if (s_.compare(p, 3, U"::=") == 0) break;
      }
      absl::StatusOr<Expr> atom = Atom();
      if (!atom.ok()) return atom;
      absl::StatusOr<Expr> repeated = Postfix(*std::move(atom));
      if (!repeated.ok()) return repeated;
      seq.children.push_back(*std::move(repeated));
    }
    if (seq.children.empty()) seq.node.kind = RegexNode::kEmpty;  // an empty alternative
    if (seq.children.size() == 1) return std::move(seq.children[0]);
    return seq;
  }

  absl::StatusOr<Expr> Postfix(Expr atom) {
    while (!AtEnd()) {
      int64_t lo = 0, hi = -1;
      const char32_t c = Peek();
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        lo = 1;
        ++pos_;
      } else if (c == '?') {
        hi = 1;
        ++pos_;
      } else if (c == '{') {
        const size_t at = pos_++;
        SkipSpace(false);
        if (!ReadCount(s_, &pos_, &lo)) return Error("expected a count in {}", at);
        SkipSpace(false);
        hi = lo;
        if (Peek() == ',') {
          ++pos_;
          SkipSpace(false);
          hi = -1;
          int64_t upper = 0;
          if (ReadCount(s_, &pos_, &upper)) hi = upper;
          SkipSpace(false);
        }
        if (Peek() != '}') return Error("expected } after a count", pos_);
        ++pos_;
        if (hi >= 0 && hi < lo) return Error("a repetition's maximum is below its minimum", at);
        if (lo > kMaxRepeatCount || hi > kMaxRepeatCount) {
          return Error(absl::StrCat("a repetition count above ", kMaxRepeatCount), at);
        }
      } else {
        break;
      }
      Expr r;
      r.node.kind = RegexNode::kRepeat;
      r.node.min = static_cast<int32_t>(lo);
      r.node.max = static_cast<int32_t>(hi);
      r.children.push_back(std::move(atom));
      atom = std::move(r);
    }
    return atom;
  }

  absl::StatusOr<Expr> Atom() {
    const size_t at = pos_;
    const char32_t c = Peek();
    Expr e;
    if (c == '"') {
      ++pos_;
      e.node.kind = RegexNode::kConcat;
      while (true) {
        if (AtEnd() || Peek() == '\n') return Error("unterminated string", at);
        if (Peek() == '"') {
          ++pos_;
          break;
        }
        absl::StatusOr<char32_t> ch = Char();
        if (!ch.ok()) return ch.status();
        Expr one;
        one.node = RegexNode::Set({{*ch, *ch}});
        e.children.push_back(std::move(one));
      }
      if (e.children.empty()) e.node.kind = RegexNode::kEmpty;
      return e;
    }
    if (c == '[') {
      ++pos_;
      const bool negated = Peek() == '^';
      if (negated) ++pos_;
      CharSet set;
      while (true) {
        if (AtEnd()) return Error("unterminated character class", at);
        if (Peek() == ']') {
          ++pos_;
          break;
        }
        absl::StatusOr<char32_t> lo = Char();
        if (!lo.ok()) return lo.status();
        char32_t hi = *lo;
        if (Peek() == '-' && Peek(1) != ']' && pos_ + 1 < s_.size()) {
          ++pos_;
          absl::StatusOr<char32_t> h = Char();
          if (!h.ok()) return h.status();
          hi = *h;
          if (hi < *lo) return Error("a character range's end is before its start", at);
        }
        set.push_back({*lo, hi});
      }
      set = Normalized(std::move(set));
      e.node = RegexNode::Set(negated ? Complement(set) : set);
      return e;
    }
    if (c == '.') {
      ++pos_;
      e.node = RegexNode::Set(Complement({}));
      return e;
    }
    if (c == '(') {
      // The parser's stack stays small whatever the client sends.
      constexpr int kMaxNesting = 200;
      if (++nesting_ > kMaxNesting) return Error("parentheses nested too deeply", at);
      ++pos_;
      SkipSpace(true);
      absl::StatusOr<Expr> inner = Alternatives(/*nested=*/true);
      --nesting_;
      if (!inner.ok()) return inner;
      SkipSpace(true);
      if (Peek() != ')' || AtEnd()) return Error("expected )", pos_);
      ++pos_;
      return inner;
    }
    if (NameChar(c)) {
      e.ref = Name();
      return e;
    }
    return Error("unexpected character", at);
  }

  // One character of a literal or class, escapes decoded.
  absl::StatusOr<char32_t> Char() {
    const size_t at = pos_;
    char32_t c = s_[pos_++];
    if (c != '\\') return c;
    if (AtEnd()) return Error("an escape at the end", at);
    c = s_[pos_++];
    auto hex = [&](int digits) -> absl::StatusOr<char32_t> {
      std::optional<char32_t> value = ReadHexEscape(s_, &pos_, digits);
      if (!value) return Error("an incomplete escape or one beyond Unicode", at);
      return *value;
    };
    switch (c) {
      case 'n':
        return U'\n';
      case 't':
        return U'\t';
      case 'r':
        return U'\r';
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      case 'U':
        return hex(8);
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
      case '^':
        return c;
      default:
        return Error("an unknown escape", at);
    }
  }

  std::u32string s_;
  size_t pos_ = 0;
  int nesting_ = 0;
};

// Rule references replaced by their bodies, from `root`. A reference to a rule being expanded
// is served where it is the last thing that rule (and every rule expanded between them) does:
// a loop back to the rule's start (right recursion: `ws ::= ([ \t] ws)?`, `list ::= item (","
// list)?`). Any other recursion makes the language context-free: refused by name.
class Inliner {
 public:
  explicit Inliner(const std::map<std::string, Expr>& rules) : rules_(rules) {}

  absl::StatusOr<RegexNode> Expand(const Expr& e, bool tail) {
    // Copies multiply (a rule used twice by a rule used twice...): bounded, as the regex
    // compiler bounds its own states.
    constexpr size_t kMaxNodes = 500'000;
    if (++nodes_ > kMaxNodes) {
      return absl::InvalidArgumentError("grammar: too large once its rules are expanded");
    }
    if (!e.ref.empty()) return Reference(e.ref, tail);
    // Nesting adds up across rules (each rule's parentheses inside the last's): the expanded
    // tree's depth is what this recursion, the automaton's construction and the tree's
    // destruction take in stack.
    constexpr int kMaxDepth = 1000;
    if (depth_ >= kMaxDepth) {
      return absl::InvalidArgumentError(absl::StrCat("grammar: nested more than ", kMaxDepth,
                                                     " deep once its rules are expanded"));
    }
    ++depth_;
    absl::StatusOr<RegexNode> out = ExpandChildren(e, tail);
    --depth_;
    return out;
  }

 private:
  absl::StatusOr<RegexNode> ExpandChildren(const Expr& e, bool tail) {
    RegexNode n = e.node;
    for (size_t i = 0; i < e.children.size(); ++i) {
      // The last of a sequence, any alternative, and an optional part keep the tail position.
      bool child_tail = tail;
      if (n.kind == RegexNode::kConcat) child_tail = tail && i + 1 == e.children.size();
      if (n.kind == RegexNode::kRepeat) child_tail = tail && n.max == 1;
      absl::StatusOr<RegexNode> child = Expand(e.children[i], child_tail);
      if (!child.ok()) return child;
      n.children.push_back(*std::move(child));
    }
    return n;
  }

  absl::StatusOr<RegexNode> Reference(const std::string& name, bool tail) {
    auto it = rules_.find(name);
    if (it == rules_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("grammar: rule ", name, " is not defined"));
    }
    for (size_t i = 0; i < active_.size(); ++i) {
      if (active_[i].first != name) continue;
      if (tail && i >= tail_from_) {
        RegexNode jump;
        jump.kind = RegexNode::kJump;
        jump.rule = active_[i].second;
        return jump;
      }
      return absl::UnimplementedError(absl::StrCat(
          "grammar: rule ", name,
          " is recursive other than at its end; only grammars of regular languages are served"));
    }
    // A chain of rules each naming the next is expanded recursively: bounded like nesting.
    constexpr size_t kMaxChain = 500;
    if (active_.size() >= kMaxChain) {
      return absl::InvalidArgumentError(
          absl::StrCat("grammar: rules reference each other more than ", kMaxChain, " deep"));
    }
    const size_t saved_tail_from = tail_from_;
    if (!tail) tail_from_ = active_.size();
    active_.emplace_back(name, next_instance_++);
    absl::StatusOr<RegexNode> body = Expand(it->second, /*tail=*/true);
    RegexNode rule;
    rule.kind = RegexNode::kRule;
    rule.rule = active_.back().second;
    active_.pop_back();
    tail_from_ = saved_tail_from;
    if (!body.ok()) return body;
    rule.children.push_back(*std::move(body));
    return rule;
  }

  const std::map<std::string, Expr>& rules_;
  // The rules being expanded, outermost first, with their instance numbers; a reference at the
  // tail of the innermost is at the tail of those from tail_from_ on.
  std::vector<std::pair<std::string, int32_t>> active_;
  size_t tail_from_ = 0;
  int32_t next_instance_ = 0;
  size_t nodes_ = 0;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<ByteDfa> CompileGbnf(std::string_view grammar) {
  std::optional<std::u32string> text = DecodeUtf8(grammar);
  if (!text) return absl::InvalidArgumentError("grammar: not valid UTF-8");
  std::map<std::string, Expr> rules;
  if (absl::Status st = GbnfParser(*std::move(text)).Parse(&rules); !st.ok()) return st;
  if (rules.count("root") == 0) return absl::InvalidArgumentError("grammar: no root rule");
  Expr root;
  root.ref = "root";
  absl::StatusOr<RegexNode> node = Inliner(rules).Expand(root, /*tail=*/true);
  if (!node.ok()) return node.status();
  absl::StatusOr<ByteDfa> dfa = CompileNode(*node);
  if (!dfa.ok()) {
    return absl::Status(dfa.status().code(), absl::StrCat("grammar: ", dfa.status().message()));
  }
  return dfa;
}

}  // namespace tgis::grammar

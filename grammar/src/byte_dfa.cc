// RegexNode -> NFA over bytes (Thompson's construction, code point sets as their UTF-8 byte
// ranges) -> DFA (subset construction over byte classes), with the states that cannot reach
// an accepting one removed and equivalent states merged (Moore's refinement).
#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "grammar/grammar.h"
#include "grammar/src/regex_ast.h"
#include "grammar/src/utf8.h"

namespace tgis::grammar {
namespace {

// A repetition's copies multiply a pattern's states: past this many the pattern is refused.
constexpr size_t kMaxNfaStates = 400000;
// Subset construction's work (NFA states visited): a pattern that needs more is refused as too
// complex, so no request holds the router for long (about a second at this bound).
constexpr size_t kMaxDeterminizeWork = 100'000'000;
// Moore's refinement costs rounds x states x classes; past this the automaton is served
// unminimized (the same language, more states) rather than delaying the request.
constexpr size_t kMaxMinimizeWork = 10'000'000;

struct NfaState {
  std::vector<std::tuple<uint8_t, uint8_t, int32_t>> edges;  // [lo, hi] -> state
  std::vector<int32_t> epsilon;
};

class NfaBuilder {
 public:
  struct Fragment {
    int32_t start, end;
  };

  absl::StatusOr<Fragment> Build(const RegexNode& n) {
    if (states_.size() > kMaxNfaStates) {
      return absl::InvalidArgumentError(
          "the pattern is too large for guided decoding (its repetitions expand too far)");
    }
    switch (n.kind) {
      case RegexNode::kEmpty: {
        const int32_t s = New();
        return Fragment{s, s};
      }
      case RegexNode::kSet: {
        const int32_t start = New(), end = New();
        for (const CodeRange& r : n.set) {
          for (const ByteRangeSeq& seq : Utf8Sequences(r.lo, r.hi)) {
            int32_t at = start;
            for (size_t i = 0; i < seq.size(); ++i) {
              const int32_t to = i + 1 == seq.size() ? end : New();
              states_[at].edges.emplace_back(seq[i].first, seq[i].second, to);
              at = to;
            }
          }
        }
        return Fragment{start, end};
      }
      case RegexNode::kConcat: {
        const int32_t start = New();
        int32_t at = start;
        for (const RegexNode& c : n.children) {
          absl::StatusOr<Fragment> f = Build(c);
          if (!f.ok()) return f;
          states_[at].epsilon.push_back(f->start);
          at = f->end;
        }
        return Fragment{start, at};
      }
      case RegexNode::kAlt: {
        const int32_t start = New(), end = New();
        for (const RegexNode& c : n.children) {
          absl::StatusOr<Fragment> f = Build(c);
          if (!f.ok()) return f;
          states_[start].epsilon.push_back(f->start);
          states_[f->end].epsilon.push_back(end);
        }
        return Fragment{start, end};
      }
      case RegexNode::kRepeat: {
        const RegexNode& c = n.children[0];
        const int32_t start = New();
        int32_t at = start;
        for (int32_t i = 0; i < n.min; ++i) {
          absl::StatusOr<Fragment> f = Build(c);
          if (!f.ok()) return f;
          states_[at].epsilon.push_back(f->start);
          at = f->end;
        }
        if (n.max < 0) {
          absl::StatusOr<Fragment> f = Build(c);
          if (!f.ok()) return f;
          const int32_t loop = New();
          states_[at].epsilon.push_back(loop);
          states_[loop].epsilon.push_back(f->start);
          states_[f->end].epsilon.push_back(loop);
          return Fragment{start, loop};
        }
        const int32_t end = New();
        for (int32_t i = n.min; i < n.max; ++i) {
          absl::StatusOr<Fragment> f = Build(c);
          if (!f.ok()) return f;
          states_[at].epsilon.push_back(end);  // stop here
          states_[at].epsilon.push_back(f->start);
          at = f->end;
        }
        states_[at].epsilon.push_back(end);
        return Fragment{start, end};
      }
      case RegexNode::kRule: {
        // The instance's start, where its tail references jump back to (while it is built;
        // each copy a repetition makes registers its own).
        const int32_t start = New();
        rule_start_[n.rule] = start;
        absl::StatusOr<Fragment> body = Build(n.children[0]);
        if (!body.ok()) return body;
        states_[start].epsilon.push_back(body->start);
        return Fragment{start, body->end};
      }
      case RegexNode::kJump: {
        auto it = rule_start_.find(n.rule);
        if (it == rule_start_.end()) return absl::InternalError("a jump outside its rule");
        const int32_t from = New();
        states_[from].epsilon.push_back(it->second);
        return Fragment{from, New()};  // nothing continues after a tail reference itself
      }
    }
    return absl::InternalError("unknown regex node");
  }

  std::vector<NfaState>& states() { return states_; }

 private:
  int32_t New() {
    states_.emplace_back();
    return static_cast<int32_t>(states_.size() - 1);
  }
  std::vector<NfaState> states_;
  std::map<int32_t, int32_t> rule_start_;  // rule instance -> its start state
};

void Closure(const std::vector<NfaState>& nfa, std::vector<int32_t>* set, std::vector<char>* seen) {
  std::vector<int32_t> stack(set->begin(), set->end());
  for (int32_t s : *set) (*seen)[s] = 1;
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    for (int32_t t : nfa[s].epsilon) {
      if ((*seen)[t]) continue;
      (*seen)[t] = 1;
      set->push_back(t);
      stack.push_back(t);
    }
  }
  for (int32_t s : *set) (*seen)[s] = 0;
  std::sort(set->begin(), set->end());
}

absl::StatusOr<ByteDfa> Determinize(const std::vector<NfaState>& nfa, int32_t start,
                                    int32_t final_state) {
  ByteDfa dfa;
  // Byte classes: bytes no edge tells apart.
  std::vector<char> boundary(257, 0);
  boundary[0] = 1;
  for (const NfaState& s : nfa) {
    for (const auto& [lo, hi, to] : s.edges) {
      boundary[lo] = 1;
      boundary[hi + 1] = 1;
    }
  }
  int32_t cls = -1;
  for (int b = 0; b < 256; ++b) {
    if (boundary[b]) {
      ++cls;
    }
    dfa.byte_class[b] = static_cast<uint8_t>(cls);
  }
  const int32_t classes = cls + 1;
  dfa.num_classes = classes;

  std::vector<char> seen(nfa.size(), 0);
  std::map<std::vector<int32_t>, int32_t> index;
  std::vector<std::vector<int32_t>> sets;
  std::vector<int32_t> first = {start};
  Closure(nfa, &first, &seen);
  index[first] = 0;
  sets.push_back(first);
  std::vector<std::vector<int32_t>> buckets(classes);
  size_t work = 0;
  for (size_t d = 0; d < sets.size(); ++d) {
    for (auto& b : buckets) b.clear();
    for (int32_t s : sets[d]) {
      work += 1 + nfa[s].edges.size();
      for (const auto& [lo, hi, to] : nfa[s].edges) {
        for (int32_t c = dfa.byte_class[lo]; c <= dfa.byte_class[hi]; ++c) buckets[c].push_back(to);
      }
    }
    for (int32_t c = 0; c < classes; ++c) {
      std::vector<int32_t>& b = buckets[c];
      if (b.empty()) {
        dfa.next.push_back(ByteDfa::kDead);
        continue;
      }
      std::sort(b.begin(), b.end());
      b.erase(std::unique(b.begin(), b.end()), b.end());
      Closure(nfa, &b, &seen);
      work += b.size();
      if (work > kMaxDeterminizeWork) {
        return absl::InvalidArgumentError(
            "the pattern is too complex for guided decoding (its automaton takes too long to "
            "build)");
      }
      auto [it, added] = index.emplace(b, static_cast<int32_t>(sets.size()));
      if (added) {
        if (static_cast<int32_t>(sets.size()) >= kMaxDfaStates) {
          return absl::InvalidArgumentError(
              absl::StrCat("the pattern is too complex for guided decoding (more than ",
                           kMaxDfaStates, " automaton states)"));
        }
        sets.push_back(b);
      }
      dfa.next.push_back(it->second);
    }
  }
  for (const auto& s : sets) {
    dfa.accepting.push_back(std::binary_search(s.begin(), s.end(), final_state));
  }
  return dfa;
}

// Drops the states that cannot reach an accepting one, then merges equivalent states.
absl::StatusOr<ByteDfa> PruneAndMinimize(const ByteDfa& in) {
  const int32_t n = in.num_states(), k = in.num_classes;
  std::vector<std::vector<int32_t>> preds(n);
  for (int32_t s = 0; s < n; ++s) {
    for (int32_t c = 0; c < k; ++c) {
      const int32_t t = in.next[s * k + c];
      if (t != ByteDfa::kDead) preds[t].push_back(s);
    }
  }
  std::vector<char> live(n, 0);
  std::vector<int32_t> stack;
  for (int32_t s = 0; s < n; ++s) {
    if (in.accepting[s]) {
      live[s] = 1;
      stack.push_back(s);
    }
  }
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    for (int32_t p : preds[s]) {
      if (!live[p]) {
        live[p] = 1;
        stack.push_back(p);
      }
    }
  }
  if (!live[0]) return absl::InvalidArgumentError("the pattern matches no text");
  // Moore's refinement; the dead state is block -1 throughout.
  std::vector<int32_t> block(n);
  for (int32_t s = 0; s < n; ++s) block[s] = live[s] ? (in.accepting[s] ? 1 : 0) : -1;
  int32_t blocks = 0;
  size_t work = 0;
  while (true) {
    work += static_cast<size_t>(n) * static_cast<size_t>(k + 1);
    if (work > kMaxMinimizeWork) {
      // Every live state its own block: pruned, not minimized.
      blocks = 0;
      for (int32_t s = 0; s < n; ++s) block[s] = live[s] ? blocks++ : -1;
      break;
    }
    std::map<std::vector<int32_t>, int32_t> signature;
    std::vector<int32_t> next_block(n, -1);
    for (int32_t s = 0; s < n; ++s) {
      if (!live[s]) continue;
      std::vector<int32_t> key = {block[s]};
      for (int32_t c = 0; c < k; ++c) {
        const int32_t t = in.next[s * k + c];
        key.push_back(t == ByteDfa::kDead || !live[t] ? -1 : block[t]);
      }
      next_block[s] =
          signature.emplace(std::move(key), static_cast<int32_t>(signature.size())).first->second;
    }
    const int32_t count = static_cast<int32_t>(signature.size());
    block = std::move(next_block);
    if (count == blocks) break;
    blocks = count;
  }
  // Number the blocks from the start's, in the order a walk from it finds them.
  std::vector<int32_t> number(blocks, -1);
  std::vector<int32_t> order;
  std::vector<int32_t> member(blocks, -1);
  for (int32_t s = 0; s < n; ++s) {
    if (live[s] && member[block[s]] < 0) member[block[s]] = s;
  }
  number[block[0]] = 0;
  order.push_back(block[0]);
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t s = member[order[i]];
    for (int32_t c = 0; c < k; ++c) {
      const int32_t t = in.next[s * k + c];
      if (t == ByteDfa::kDead || !live[t] || number[block[t]] >= 0) continue;
      number[block[t]] = static_cast<int32_t>(order.size());
      order.push_back(block[t]);
    }
  }
  ByteDfa out;
  out.byte_class = in.byte_class;
  out.num_classes = k;
  for (int32_t b : order) {
    const int32_t s = member[b];
    out.accepting.push_back(in.accepting[s]);
    for (int32_t c = 0; c < k; ++c) {
      const int32_t t = in.next[s * k + c];
      out.next.push_back(t == ByteDfa::kDead || !live[t] ? ByteDfa::kDead : number[block[t]]);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<ByteDfa> CompileNode(const RegexNode& root) {
  NfaBuilder builder;
  absl::StatusOr<NfaBuilder::Fragment> f = builder.Build(root);
  if (!f.ok()) return f.status();
  absl::StatusOr<ByteDfa> dfa = Determinize(builder.states(), f->start, f->end);
  if (!dfa.ok()) return dfa;
  return PruneAndMinimize(*dfa);
}

int32_t ByteDfa::Walk(int32_t state, std::string_view bytes) const {
  for (char b : bytes) {
    if (state == kDead) return kDead;
    state = Step(state, static_cast<uint8_t>(b));
  }
  return state;
}

bool ByteDfa::Matches(std::string_view text) const {
  const int32_t s = Walk(0, text);
  return s != kDead && accepting[s];
}

bool ByteDfa::HasTransitions(int32_t state) const {
  for (int32_t c = 0; c < num_classes; ++c) {
    if (next[static_cast<size_t>(state) * num_classes + c] != kDead) return true;
  }
  return false;
}

absl::Status ByteDfa::Validate() const {
  if (num_classes < 1 || num_classes > 256) return absl::InvalidArgumentError("bad class count");
  for (uint8_t c : byte_class) {
    if (c >= num_classes) return absl::InvalidArgumentError("a byte class out of range");
  }
  if (accepting.empty() || num_states() > kMaxDfaStates) {
    return absl::InvalidArgumentError("bad state count");
  }
  if (next.size() != accepting.size() * static_cast<size_t>(num_classes)) {
    return absl::InvalidArgumentError("the transition table's size does not match");
  }
  for (int32_t t : next) {
    if (t != kDead && (t < 0 || t >= num_states())) {
      return absl::InvalidArgumentError("a transition to a state out of range");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ByteDfa> CompileRegex(std::string_view pattern) {
  absl::StatusOr<RegexNode> root = ParseRegex(pattern);
  if (!root.ok()) return root.status();
  return CompileNode(*root);
}

absl::StatusOr<ByteDfa> CompileChoices(const std::vector<std::string>& choices) {
  if (choices.empty()) return absl::InvalidArgumentError("no choices");
  RegexNode alt;
  alt.kind = RegexNode::kAlt;
  for (const std::string& c : choices) {
    std::optional<std::u32string> text = DecodeUtf8(c);
    if (!text) return absl::InvalidArgumentError("a choice is not valid UTF-8");
    alt.children.push_back(RegexNode::Literal(*text));
  }
  return CompileNode(alt);
}

}  // namespace tgis::grammar

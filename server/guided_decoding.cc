#include "server/guided_decoding.h"

#include <algorithm>
#include <bit>
#include <limits>

namespace tgis::server {

GuidedVocabulary::GuidedVocabulary(TokenBytesTable bytes) : bytes_(std::move(bytes)) {
  std::vector<int32_t> order;
  for (size_t id = 0; id < bytes_.size(); ++id) {
    if (!bytes_[id].empty()) order.push_back(static_cast<int32_t>(id));
  }
  // Lexicographic order puts every prefix's tokens side by side, a token before those that
  // extend it, and equal ones together: each node's tokens are one run of ids_.
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return bytes_[a] < bytes_[b]; });
  std::vector<int32_t> path;  // the open nodes from depth 1 down
  const std::string* previous = nullptr;
  for (int32_t id : order) {
    const std::string& b = bytes_[id];
    size_t shared = 0;
    if (previous != nullptr) {
      const size_t most = std::min(previous->size(), b.size());
      while (shared < most && (*previous)[shared] == b[shared]) ++shared;
    }
    for (; path.size() > shared; path.pop_back()) {
      skip_[path.back()] = static_cast<int32_t>(byte_.size());
    }
    for (size_t d = shared; d < b.size(); ++d) {
      path.push_back(static_cast<int32_t>(byte_.size()));
      byte_.push_back(static_cast<uint8_t>(b[d]));
      depth_.push_back(static_cast<int32_t>(d + 1));
      skip_.push_back(0);
      first_id_.push_back(static_cast<int32_t>(ids_.size()));
    }
    ids_.push_back(id);
    max_depth_ = std::max(max_depth_, static_cast<int32_t>(b.size()));
    previous = &b;
  }
  for (; !path.empty(); path.pop_back()) skip_[path.back()] = static_cast<int32_t>(byte_.size());
  first_id_.push_back(static_cast<int32_t>(ids_.size()));
}

std::vector<uint64_t> GuidedVocabulary::Allowed(const grammar::ByteDfa& dfa, int32_t state) const {
  std::vector<uint64_t> bits((bytes_.size() + 63) / 64, 0);
  // states[d]: the automaton's state after the current node's first d bytes. In preorder the
  // last node visited at depth d - 1 is the current node's parent.
  std::vector<int32_t> states(static_cast<size_t>(max_depth_) + 1);
  states[0] = state;
  const size_t nodes = byte_.size();
  for (size_t i = 0; i < nodes;) {
    const int32_t d = depth_[i];
    const int32_t next = dfa.Step(states[d - 1], byte_[i]);
    if (next == grammar::ByteDfa::kDead) {
      i = static_cast<size_t>(skip_[i]);  // no token under this prefix can come
      continue;
    }
    states[d] = next;
    for (int32_t k = first_id_[i]; k < first_id_[i + 1]; ++k) {
      bits[ids_[k] / 64] |= uint64_t{1} << (ids_[k] % 64);
    }
    ++i;
  }
  return bits;
}

GuidedAutomaton::GuidedAutomaton(std::shared_ptr<const grammar::ByteDfa> dfa,
                                 std::shared_ptr<const GuidedVocabulary> vocabulary)
    : dfa_(std::move(dfa)), vocabulary_(std::move(vocabulary)) {}

std::shared_ptr<const std::vector<uint64_t>> GuidedAutomaton::Allowed(int32_t state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = masks_.find(state); it != masks_.end()) return it->second;
  }
  // Computed outside the lock (a walk of the vocabulary's trie); two sequences reaching a new
  // state at once compute the same mask, and the first stored wins.
  auto bits = std::make_shared<const std::vector<uint64_t>>(vocabulary_->Allowed(*dfa_, state));
  std::lock_guard<std::mutex> lock(mu_);
  return masks_.emplace(state, std::move(bits)).first->second;
}

void GuidedAutomatonCache::SetVocabulary(std::shared_ptr<const GuidedVocabulary> vocabulary) {
  vocabulary_ = std::move(vocabulary);
  cache_.Clear();
}

TokenConstraint::TokenConstraint(std::shared_ptr<GuidedAutomaton> automaton,
                                 std::vector<int32_t> eos)
    : automaton_(std::move(automaton)), eos_(std::move(eos)) {}

bool TokenConstraint::MustEnd() const {
  if (ended_) return true;
  if (!automaton_->dfa().accepting[state_]) return false;
  if (!automaton_->dfa().HasTransitions(state_)) return true;
  // Complete, and the pattern could go on, but no token of the vocabulary does.
  const std::shared_ptr<const std::vector<uint64_t>> allowed = automaton_->Allowed(state_);
  return std::all_of(allowed->begin(), allowed->end(), [](uint64_t w) { return w == 0; });
}

bool TokenConstraint::Mask(std::span<float> logits) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t v = static_cast<int64_t>(logits.size());
  const bool complete = ended_ || automaton_->dfa().accepting[state_];
  std::vector<float> eos_values;
  for (int32_t e : eos_) eos_values.push_back(e >= 0 && e < v ? logits[e] : 0.0f);
  bool any = false;
  if (ended_) {
    std::fill(logits.begin(), logits.end(), kNegInf);
  } else {
    const std::shared_ptr<const std::vector<uint64_t>> allowed = automaton_->Allowed(state_);
    const std::vector<uint64_t>& bits = *allowed;
    // A word at a time: most words of a state's mask are empty (64 ids masked in one fill),
    // and a mixed word visits only its masked ids.
    for (int64_t begin = 0; begin < v; begin += 64) {
      const int64_t end = std::min<int64_t>(begin + 64, v);
      const size_t word = static_cast<size_t>(begin / 64);
      uint64_t w = word < bits.size() ? bits[word] : 0;
      if (end - begin < 64) w &= (uint64_t{1} << (end - begin)) - 1;  // ids past the logits
      if (w == 0) {
        std::fill(logits.begin() + begin, logits.begin() + end, kNegInf);
        continue;
      }
      any = true;
      uint64_t masked = ~w;
      if (end - begin < 64) masked &= (uint64_t{1} << (end - begin)) - 1;
      for (; masked != 0; masked &= masked - 1) logits[begin + std::countr_zero(masked)] = kNegInf;
    }
  }
  for (size_t k = 0; k < eos_.size(); ++k) {
    if (eos_[k] < 0 || eos_[k] >= v) continue;
    logits[eos_[k]] = complete ? eos_values[k] : kNegInf;
    any = any || complete;
  }
  return any;
}

void TokenConstraint::Advance(int32_t token) {
  if (ended_) return;
  if (std::find(eos_.begin(), eos_.end(), token) != eos_.end()) {
    ended_ = true;
    return;
  }
  const TokenBytesTable& vocab = automaton_->vocabulary().bytes();
  if (token < 0 || static_cast<size_t>(token) >= vocab.size()) return;
  const int32_t next = automaton_->dfa().Walk(state_, vocab[token]);
  if (next != grammar::ByteDfa::kDead) state_ = next;
}

}  // namespace tgis::server

#include "server/guided_decoding.h"

#include <algorithm>
#include <limits>

namespace tgis::server {

GuidedAutomaton::GuidedAutomaton(std::shared_ptr<const grammar::ByteDfa> dfa,
                                 std::shared_ptr<const TokenBytesTable> vocabulary)
    : dfa_(std::move(dfa)), vocabulary_(std::move(vocabulary)) {}

std::shared_ptr<const std::vector<uint64_t>> GuidedAutomaton::Allowed(int32_t state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = masks_.find(state); it != masks_.end()) return it->second;
  }
  // Computed outside the lock (a walk of the whole vocabulary); two sequences reaching a new
  // state at once compute the same mask, and the first stored wins.
  const TokenBytesTable& vocab = *vocabulary_;
  auto bits = std::make_shared<std::vector<uint64_t>>((vocab.size() + 63) / 64, 0);
  for (size_t id = 0; id < vocab.size(); ++id) {
    const std::string& bytes = vocab[id];
    if (!bytes.empty() && dfa_->Walk(state, bytes) != grammar::ByteDfa::kDead) {
      (*bits)[id / 64] |= uint64_t{1} << (id % 64);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  return masks_.emplace(state, std::move(bits)).first->second;
}

void GuidedAutomatonCache::SetVocabulary(std::shared_ptr<const TokenBytesTable> vocabulary) {
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
    for (int64_t id = 0; id < v; ++id) {
      const size_t word = static_cast<size_t>(id) / 64;
      if (word < bits.size() && ((bits[word] >> (id % 64)) & 1)) {
        any = true;
      } else {
        logits[id] = kNegInf;
      }
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
  const TokenBytesTable& vocab = automaton_->vocabulary();
  if (token < 0 || static_cast<size_t>(token) >= vocab.size()) return;
  const int32_t next = automaton_->dfa().Walk(state_, vocab[token]);
  if (next != grammar::ByteDfa::kDead) state_ = next;
}

}  // namespace tgis::server

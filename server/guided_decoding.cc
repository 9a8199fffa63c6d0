#include "server/guided_decoding.h"

#include <algorithm>
#include <limits>

namespace tgis::server {

TokenConstraint::TokenConstraint(std::shared_ptr<const grammar::ByteDfa> dfa,
                                 std::shared_ptr<const TokenBytesTable> vocabulary,
                                 std::vector<int32_t> eos)
    : dfa_(std::move(dfa)), vocabulary_(std::move(vocabulary)), eos_(std::move(eos)) {}

const std::vector<uint64_t>& TokenConstraint::Allowed() {
  auto [it, added] = masks_.try_emplace(state_);
  if (!added) return it->second;
  const TokenBytesTable& vocab = *vocabulary_;
  std::vector<uint64_t>& bits = it->second;
  bits.assign((vocab.size() + 63) / 64, 0);
  for (size_t id = 0; id < vocab.size(); ++id) {
    const std::string& bytes = vocab[id];
    if (bytes.empty()) continue;
    if (dfa_->Walk(state_, bytes) != grammar::ByteDfa::kDead)
      bits[id / 64] |= uint64_t{1} << (id % 64);
  }
  return bits;
}

bool TokenConstraint::MustEnd() const {
  return ended_ || (dfa_->accepting[state_] && !dfa_->HasTransitions(state_));
}

bool TokenConstraint::Mask(std::span<float> logits) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t v = static_cast<int64_t>(logits.size());
  std::vector<char> eos_allowed;
  for (int32_t e : eos_) {
    eos_allowed.push_back(e >= 0 && e < v && (ended_ || dfa_->accepting[state_]) ? 1 : 0);
  }
  std::vector<float> eos_values;
  for (int32_t e : eos_) eos_values.push_back(e >= 0 && e < v ? logits[e] : 0.0f);
  bool any = false;
  if (ended_) {
    std::fill(logits.begin(), logits.end(), kNegInf);
  } else {
    const std::vector<uint64_t>& bits = Allowed();
    for (int64_t id = 0; id < v; ++id) {
      const size_t word = static_cast<size_t>(id) / 64;
      const bool ok = word < bits.size() && ((bits[word] >> (id % 64)) & 1);
      if (!ok) {
        logits[id] = kNegInf;
      } else {
        any = true;
      }
    }
  }
  for (size_t k = 0; k < eos_.size(); ++k) {
    if (eos_allowed[k]) {
      logits[eos_[k]] = eos_values[k];
      any = true;
    } else if (eos_[k] >= 0 && eos_[k] < v) {
      logits[eos_[k]] = kNegInf;
    }
  }
  return any;
}

void TokenConstraint::Advance(int32_t token) {
  if (ended_) return;
  if (std::find(eos_.begin(), eos_.end(), token) != eos_.end()) {
    ended_ = true;
    return;
  }
  const TokenBytesTable& vocab = *vocabulary_;
  if (token < 0 || static_cast<size_t>(token) >= vocab.size()) return;
  const int32_t next = dfa_->Walk(state_, vocab[token]);
  if (next != grammar::ByteDfa::kDead) state_ = next;
}

}  // namespace tgis::server

#include "server/sampling.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "kernels/ops.h"
#include "server/guided_decoding.h"

namespace tgis::server {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}

void LogSoftmaxInto(std::span<const float> logits, std::vector<float>* out) {
  out->resize(logits.size());
  const float lse = kernels::LogSumExp(logits);
  for (size_t i = 0; i < logits.size(); ++i) (*out)[i] = logits[i] - lse;
}

void RankAndTop(std::span<const float> lp, int32_t id, uint32_t top_n, uint32_t* rank,
                std::vector<TopToken>* top) {
  const float chosen = lp[id];
  uint32_t better = 0;
  for (float v : lp) better += v > chosen;
  *rank = better + 1;
  top->clear();
  if (top_n == 0) return;
  std::vector<int32_t> idx(lp.size());
  std::iota(idx.begin(), idx.end(), 0);
  const size_t n = std::min<size_t>(top_n, lp.size());
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&lp](int32_t a, int32_t b) {
    return lp[a] > lp[b] || (lp[a] == lp[b] && a < b);
  });
  const float cutoff = lp[idx[n - 1]];
  for (size_t i = 0; i < n; ++i) top->push_back({idx[i], lp[idx[i]]});
  // Ties with the last one are included too (TGIS returns more than n on ties).
  std::vector<int32_t> ties;
  for (size_t i = 0; i < lp.size(); ++i) {
    if (lp[i] == cutoff &&
        std::find(idx.begin(), idx.begin() + n, static_cast<int32_t>(i)) == idx.begin() + n) {
      ties.push_back(static_cast<int32_t>(i));
    }
  }
  for (int32_t t : ties) top->push_back({t, lp[t]});
}

namespace {

// The token ids in decreasing probability, ties by increasing id (the order a stable sort by
// probability gives), sorted lazily: only as long a prefix as the warpers and the draw read.
// Most of the mass sits in a few hundred tokens, and a whole stable sort of Llama 3's 128K
// vocabulary took 14-16 ms per sampled token on this project's CI machine (3 ms at 32K);
// nth_element over all of them still took 1.6 ms. The prefix is found by the probabilities'
// binary exponents instead: one pass counts tokens per exponent, and every token whose exponent
// is at least the lowest one that holds enough of them is a candidate; the candidates, sorted,
// are the order's first tokens (any other token's probability is smaller than all of theirs).
class SortedTokens {
 public:
  explicit SortedTokens(const std::vector<float>& prob) : prob_(prob) {
    for (float p : prob_) ++count_[Exponent(p)];
  }
  // The i-th token of the order.
  int32_t at(size_t i) {
    Extend(i + 1);
    return prefix_[i];
  }
  // Sorts at least the first n (growing the sorted prefix geometrically, so a walk down the
  // order costs a few passes, not one per step).
  void Extend(size_t n) {
    if (n <= prefix_.size()) return;
    const size_t want = std::min(prob_.size(), std::max(n, 4 * prefix_.size() + 256));
    size_t held = 0;
    int lowest = 256;
    while (held < want) held += count_[--lowest];
    prefix_.clear();
    prefix_.reserve(held);
    for (size_t i = 0; i < prob_.size(); ++i) {
      if (Exponent(prob_[i]) >= lowest) prefix_.push_back(static_cast<int32_t>(i));
    }
    std::sort(prefix_.begin(), prefix_.end(), [this](int32_t a, int32_t b) {
      return prob_[a] > prob_[b] || (prob_[a] == prob_[b] && a < b);
    });
    lowest_ = lowest;
  }
  // The order's first n ids.
  std::vector<int32_t> First(size_t n) {
    Extend(n);
    return std::vector<int32_t>(prefix_.begin(), prefix_.begin() + static_cast<std::ptrdiff_t>(n));
  }
  // The sum of every token's probability: the sorted prefix in order, then the rest by id.
  double Total() const {
    double total = 0;
    for (int32_t id : prefix_) total += prob_[id];
    for (float p : prob_) {
      if (Exponent(p) < lowest_) total += p;
    }
    return total;
  }

 private:
  // A probability's biased binary exponent (0 for zero and subnormals): larger exponent,
  // larger value.
  static int Exponent(float p) {
    uint32_t bits;
    std::memcpy(&bits, &p, sizeof bits);
    return static_cast<int>((bits >> 23) & 0xFF);
  }

  const std::vector<float>& prob_;
  std::array<size_t, 256> count_{};
  std::vector<int32_t> prefix_;  // the order's first tokens, sorted
  int lowest_ = 256;             // the prefix holds every token of at least this exponent
};

}  // namespace

int32_t Sampler::Draw(const std::vector<float>& lp, std::optional<int32_t> draft) {
  // Warpers on a probability vector.
  const size_t v = lp.size();
  std::vector<float> prob(v);
  for (size_t i = 0; i < v; ++i) prob[i] = std::exp(lp[i]);
  SortedTokens sorted(prob);
  size_t keep = v;
  if (p_.top_k > 0) keep = std::min<size_t>(keep, p_.top_k);
  if (p_.top_p > 0 && p_.top_p < 1.0f) {
    double cum = 0;
    size_t k = 0;
    while (k < keep) {
      cum += prob[sorted.at(k)];
      ++k;
      if (cum >= p_.top_p) break;
    }
    keep = std::max<size_t>(1, k);
  }
  // The kept tokens, in the order the draw walks them: the sorted prefix of `keep`, or, after
  // typical_p, its own order (explicit then).
  std::vector<int32_t> order;
  const bool typical = p_.typical_p > 0 && p_.typical_p < 1.0f;
  if (typical) {
    // Keep the tokens whose surprisal is closest to the entropy until typical_p mass.
    double entropy = 0;
    for (size_t i = 0; i < v; ++i) {
      if (prob[i] > 0) entropy -= prob[i] * lp[i];
    }
    std::vector<int32_t> by_typical = sorted.First(keep);
    std::stable_sort(by_typical.begin(), by_typical.end(), [&](int32_t a, int32_t b) {
      return std::abs(-lp[a] - entropy) < std::abs(-lp[b] - entropy);
    });
    double cum = 0;
    size_t k = 0;
    while (k < by_typical.size()) {
      cum += prob[by_typical[k]];
      ++k;
      if (cum >= p_.typical_p) break;
    }
    by_typical.resize(std::max<size_t>(1, k));
    order = std::move(by_typical);
    keep = order.size();
  } else if (draft.has_value() || keep < v) {
    order = sorted.First(keep);
  }
  auto kept = [&](size_t i) { return order.empty() ? sorted.at(i) : order[i]; };
  // Every token kept (no truncation): summed without sorting them all, which moves the total
  // by at most the last bits of a double.
  double total = 0;
  if (order.empty()) {
    total = sorted.Total();
  } else {
    for (int32_t id : order) total += prob[id];
  }
  if (draft.has_value()) {
    // Accept the draft with its probability; else draw among the others.
    const auto at = std::find(order.begin(), order.end(), *draft);
    const double p_draft = at == order.end() ? 0.0 : prob[*draft] / total;
    std::uniform_real_distribution<double> coin(0.0, 1.0);
    if (coin(rng_) < p_draft) return *draft;
    if (at != order.end()) {
      total -= prob[*draft];
      order.erase(at);
      keep = order.size();
      // Only the draft was left: a rejection has nothing else to give (p_draft was 1).
      if (order.empty() || total <= 0) return *draft;
    }
  }
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  for (size_t i = 0; i < keep; ++i) {
    const int32_t id = kept(i);
    r -= prob[id];
    if (r <= 0) return id;
  }
  return kept(keep - 1);
}

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> eos_ids)
    : p_(params), eos_(std::move(eos_ids)), rng_(params.seed) {}

Sampler::~Sampler() = default;

void Sampler::SetConstraint(std::unique_ptr<TokenConstraint> constraint) {
  constraint_ = std::move(constraint);
}

bool Sampler::RepetitionPenalized() const {
  return p_.repetition_penalty > 0 && p_.repetition_penalty != 1.0f;
}

bool Sampler::LengthPenalized(uint32_t generated) const {
  return p_.length_penalty_decay > 0 && generated > p_.length_penalty_start;
}

TokenChoice Sampler::Next(std::span<float> logits, std::span<const int32_t> context,
                          uint32_t generated, uint32_t top_n, std::optional<int32_t> draft,
                          bool penalty_applied) {
  const int64_t v = static_cast<int64_t>(logits.size());
  // Processors.
  if (RepetitionPenalized() && !penalty_applied) {
    std::vector<uint8_t> seen(v, 0);
    for (int32_t t : context) {
      if (t < 0 || t >= v || seen[t]) continue;
      seen[t] = 1;
      float& x = logits[t];
      x = x < 0 ? x * p_.repetition_penalty : x / p_.repetition_penalty;
    }
  }
  if (LengthPenalized(generated)) {
    const double boost = std::pow(static_cast<double>(p_.length_penalty_decay),
                                  static_cast<double>(generated - p_.length_penalty_start)) -
                         1.0;
    for (int32_t e : eos_) {
      if (e >= 0 && e < v) logits[e] += std::abs(logits[e]) * static_cast<float>(boost);
    }
  }
  if (generated < p_.min_new_tokens && !(constraint_ && constraint_->MustEnd())) {
    for (int32_t e : eos_) {
      if (e >= 0 && e < v) logits[e] = kNegInf;
    }
  }
  if (constraint_ && !constraint_->Mask(logits)) {
    TokenChoice none;
    none.id = -1;
    return none;
  }
  if (p_.do_sample && p_.temperature > 0 && p_.temperature != 1.0f) {
    for (float& x : logits) x /= p_.temperature;
  }
  // Details come from the distribution before truncation.
  std::vector<float> lp;
  LogSoftmaxInto(logits, &lp);
  TokenChoice choice;
  if (!p_.do_sample) {
    choice.id =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  } else {
    choice.id = Draw(lp, draft);
  }
  choice.logprob = lp[choice.id];
  RankAndTop(lp, choice.id, top_n, &choice.rank, &choice.top);
  if (constraint_) constraint_->Advance(choice.id);
  return choice;
}

Sampler::DeviceSteps Sampler::ForDevice(uint32_t generated) const {
  DeviceSteps d;
  d.mask_eos = generated < p_.min_new_tokens;
  if (RepetitionPenalized()) d.repetition_penalty = p_.repetition_penalty;
  if (p_.do_sample && p_.temperature > 0 && p_.temperature != 1.0f) d.temperature = p_.temperature;
  const bool length = LengthPenalized(generated);
  const bool typical = p_.do_sample && p_.typical_p > 0 && p_.typical_p < 1.0f;
  d.greedy = !p_.do_sample && !length && !constraint_;
  d.from_top = !length && !typical && !constraint_;
  return d;
}

std::optional<TokenChoice> Sampler::NextFromTop(std::span<const float> values,
                                                std::span<const int32_t> ids, float lse, float mass,
                                                int64_t vocab, uint32_t top_n) {
  struct Candidate {
    int32_t id;
    float value, lp, prob;
  };
  const size_t c = values.size();
  if (c == 0) return std::nullopt;
  std::vector<Candidate> cand(c);
  for (size_t i = 0; i < c; ++i) {
    const float lp = values[i] - lse;  // as LogSoftmaxInto and Draw compute them
    cand[i] = {ids[i], values[i], lp, std::exp(lp)};
  }
  // Draw's order: probability descending, ties by id. A token not given has a value, so a
  // log-probability and a probability, no larger than the smallest given: the given tokens
  // whose probability is larger than that come first in the whole row's order too, in this
  // order ("settled"); past them, tokens not given may tie in.
  std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) {
    return a.prob > b.prob || (a.prob == b.prob && a.id < b.id);
  });
  const bool whole = static_cast<int64_t>(c) == vocab;
  size_t settled = c;
  if (!whole) {
    settled = 0;
    while (settled < c && cand[settled].prob > cand.back().prob) ++settled;
  }
  // RankAndTop's top n (before the draw: a row that cannot give them leaves the generator
  // untouched).
  std::vector<TopToken> top;
  if (top_n > 0) {
    std::vector<Candidate> by_lp = cand;
    std::sort(by_lp.begin(), by_lp.end(), [](const Candidate& a, const Candidate& b) {
      return a.lp > b.lp || (a.lp == b.lp && a.id < b.id);
    });
    const size_t n = std::min<size_t>(top_n, static_cast<size_t>(vocab));
    if (n > c) return std::nullopt;
    const float cutoff = by_lp[n - 1].lp;
    // Ties with the n-th may include tokens not given when it is as low as the lowest given.
    if (!whole && cutoff <= by_lp.back().lp) return std::nullopt;
    for (size_t i = 0; i < n; ++i) top.push_back({by_lp[i].id, by_lp[i].lp});
    // The other ties with the n-th, by id (RankAndTop appends them in index order).
    for (size_t i = n; i < c && by_lp[i].lp == cutoff; ++i) {
      top.push_back({by_lp[i].id, by_lp[i].lp});
    }
  }
  TokenChoice choice;
  if (!p_.do_sample) {
    // Next's argmax of the logits: the largest value, the first id among equals.
    const Candidate* best = &cand[0];
    for (const Candidate& k : cand) {
      if (k.value > best->value || (k.value == best->value && k.id < best->id)) best = &k;
    }
    choice.id = best->id;
  } else {
    size_t keep = static_cast<size_t>(vocab);
    if (p_.top_k > 0) keep = std::min<size_t>(keep, p_.top_k);
    if (p_.top_p > 0 && p_.top_p < 1.0f) {
      double cum = 0;
      size_t k = 0;
      while (k < keep) {
        if (k >= settled) return std::nullopt;
        cum += cand[k].prob;
        ++k;
        if (cum >= p_.top_p) break;
      }
      keep = std::max<size_t>(1, k);
    }
    double total = mass;
    if (keep < static_cast<size_t>(vocab)) {
      if (keep > settled) return std::nullopt;
      total = 0;
      for (size_t i = 0; i < keep; ++i) total += cand[i].prob;
    }
    const std::mt19937_64 before = rng_;
    std::uniform_real_distribution<double> uni(0.0, total);
    double r = uni(rng_);
    std::optional<size_t> at;
    for (size_t i = 0; i < keep; ++i) {
      if (i >= settled) {  // the draw walks past the tokens given
        rng_ = before;
        return std::nullopt;
      }
      r -= cand[i].prob;
      if (r <= 0) {
        at = i;
        break;
      }
    }
    choice.id = cand[at.value_or(keep - 1)].id;
  }
  const auto chosen =
      std::find_if(cand.begin(), cand.end(), [&](const Candidate& k) { return k.id == choice.id; });
  choice.logprob = chosen->lp;
  // RankAndTop: tokens not given have log-probabilities no larger than any given one's, so
  // none is strictly above a given token's.
  choice.rank = 1;
  for (const Candidate& k : cand) choice.rank += k.lp > chosen->lp;
  choice.top = std::move(top);
  return choice;
}

}  // namespace tgis::server

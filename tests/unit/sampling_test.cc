// Sampler: rejection sampling against a speculative draft keeps the sampling distribution.
// A statistical test with fixed seeds (deterministic, so it cannot flake): chi-square of the
// observed counts against the warped distribution computed here from its definition.
#include "server/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/ops.h"

namespace {

using tgis::server::Sampler;
using tgis::server::SamplingParams;

// softmax(logits / temperature) over the top_k most likely, renormalized.
std::vector<double> Warped(const std::vector<float>& logits, float temperature, size_t top_k) {
  std::vector<double> p(logits.size(), 0.0);
  std::vector<size_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  double total = 0;
  for (size_t k = 0; k < top_k; ++k) {
    p[order[k]] = std::exp(static_cast<double>(logits[order[k]]) / temperature);
    total += p[order[k]];
  }
  for (double& x : p) x /= total;
  return p;
}

TEST(Sampler, ADraftLeavesTheSamplingDistributionUnchanged) {
  const std::vector<float> logits = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -1.0f};
  SamplingParams params;
  params.do_sample = true;
  params.temperature = 0.8f;
  params.top_k = 5;
  const std::vector<double> want = Warped(logits, 0.8f, 5);
  constexpr int kDraws = 60000;
  // The likeliest token, an unlikely one, and one top-k removes (never accepted).
  for (int32_t draft : {0, 3, 5}) {
    params.seed = 1000 + static_cast<uint64_t>(draft);
    Sampler sampler(params, {});
    std::vector<int> counts(logits.size(), 0);
    int accepted = 0;
    for (int n = 0; n < kDraws; ++n) {
      std::vector<float> row = logits;
      const int32_t id = sampler.Next(row, {}, 1, 0, draft).id;
      ++counts[id];
      accepted += id == draft;
    }
    double chi2 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] == 0) {
        EXPECT_EQ(counts[i], 0) << "draft " << draft << ": token " << i << " is outside top-k";
        continue;
      }
      const double expected = want[i] * kDraws;
      chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
    }
    // 4 degrees of freedom: P(chi2 > 23.5) = 1e-4 for the right distribution, while a sampler
    // that over-accepts the draft by even 1% of the draws lands far above it.
    EXPECT_LT(chi2, 23.5) << "draft " << draft;
    EXPECT_NEAR(static_cast<double>(accepted) / kDraws, want[draft], 0.01) << "draft " << draft;
  }
}

TEST(Sampler, GreedyIgnoresTheDraft) {
  SamplingParams params;
  Sampler sampler(params, {});
  std::vector<float> row = {0.1f, 3.0f, 0.2f};
  EXPECT_EQ(sampler.Next(row, {}, 0, 0, 2).id, 1);
}

// The sampler sorts only as much of the vocabulary as the warpers and the draw read; the
// choices must be those of sorting it all (a stable sort by probability, then the warpers and
// an inverse-CDF walk, as the sampler was first written), with the same random numbers.
int32_t DrawByFullSort(const std::vector<float>& lp, const SamplingParams& p,
                       std::mt19937_64* rng) {
  const size_t v = lp.size();
  std::vector<float> prob(v);
  for (size_t i = 0; i < v; ++i) prob[i] = std::exp(lp[i]);
  std::vector<int32_t> order(v);
  for (size_t i = 0; i < v; ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&prob](int32_t a, int32_t b) { return prob[a] > prob[b]; });
  size_t keep = v;
  if (p.top_k > 0) keep = std::min<size_t>(keep, p.top_k);
  if (p.top_p > 0 && p.top_p < 1.0f) {
    double cum = 0;
    size_t k = 0;
    while (k < keep) {
      cum += prob[order[k]];
      ++k;
      if (cum >= p.top_p) break;
    }
    keep = std::max<size_t>(1, k);
  }
  order.resize(keep);
  if (p.typical_p > 0 && p.typical_p < 1.0f) {
    double entropy = 0;
    for (size_t i = 0; i < v; ++i) {
      if (prob[i] > 0) entropy -= prob[i] * lp[i];
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return std::abs(-lp[a] - entropy) < std::abs(-lp[b] - entropy);
    });
    double cum = 0;
    size_t k = 0;
    while (k < order.size()) {
      cum += prob[order[k]];
      ++k;
      if (cum >= p.typical_p) break;
    }
    order.resize(std::max<size_t>(1, k));
  }
  double total = 0;
  for (int32_t id : order) total += prob[id];
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(*rng);
  for (int32_t id : order) {
    r -= prob[id];
    if (r <= 0) return id;
  }
  return order.back();
}

TEST(Sampler, PartialSortingChoosesWhatAFullSortChooses) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t vocab : {7, 1000, 20000, 3000}) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = normal(gen);
    // The last: a flat distribution (every token in one exponent bin; long walks).
    if (vocab == 3000) std::fill(logits.begin(), logits.end(), 0.25f);
    // Ties (equal probabilities keep id order) and tokens that can never be drawn.
    for (size_t i = 0; i + 3 < vocab; i += 97) logits[i + 3] = logits[i];
    logits[vocab / 2] = -std::numeric_limits<float>::infinity();
    for (int top_k : {0, 1, 5, 300}) {
      for (float top_p : {1.0f, 0.3f, 0.95f}) {
        for (float typical_p : {1.0f, 0.8f}) {
          for (float temperature : {1.0f, 2.5f}) {
            SamplingParams p;
            p.do_sample = true;
            p.top_k = top_k;
            p.top_p = top_p;
            p.typical_p = typical_p;
            p.temperature = temperature;
            p.seed = 11 + vocab;
            Sampler sampler(p, {});
            std::mt19937_64 rng(p.seed);
            std::vector<float> scaled = logits;
            if (temperature != 1.0f) {
              for (float& x : scaled) x /= temperature;
            }
            std::vector<float> lp;
            tgis::server::LogSoftmaxInto(scaled, &lp);
            for (int draw = 0; draw < 20; ++draw) {
              std::vector<float> step = logits;
              const int32_t got = sampler.Next(step, {}, 1, 0).id;
              ASSERT_EQ(got, DrawByFullSort(lp, p, &rng))
                  << "vocab " << vocab << " top_k " << top_k << " top_p " << top_p << " typical_p "
                  << typical_p << " temperature " << temperature << " draw " << draw;
            }
          }
        }
      }
    }
  }
}

// A greedy request with a repetition penalty picks on the device (the engine runs the
// RepetitionPenalty and GreedyPick ops): the same token as the host sampler, and its logprob
// up to the f32 log-sum-exp's rounding.
TEST(Sampler, PenalizedGreedyOpsChooseWhatTheSamplerChooses) {
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t v = 5000;
  for (float penalty : {1.2f, 0.8f, 3.0f}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> logits(v);
      for (float& x : logits) x = normal(gen);
      std::vector<int32_t> context;
      std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(v) - 1);
      for (int i = 0; i < 40; ++i) context.push_back(token(gen));
      // The context's likeliest tokens, so that the penalty changes the choice.
      for (int i = 0; i < 3; ++i) {
        context.push_back(
            static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
        logits[context.back()] += 0.5f;
      }
      context.push_back(context.front());  // a repeat: penalized once
      SamplingParams p;
      p.repetition_penalty = penalty;
      Sampler sampler(p, {});
      const Sampler::DeviceSteps d = sampler.ForDevice(0);
      ASSERT_TRUE(d.greedy);
      EXPECT_FALSE(d.mask_eos);
      ASSERT_EQ(d.repetition_penalty, penalty);
      std::vector<float> host = logits;
      const tgis::server::TokenChoice want = sampler.Next(host, context, 0, 0);

      std::vector<int32_t> distinct = context;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      using tgis::kernels::Tensor;
      Tensor t = Tensor::FromVector(logits, {1, v});
      tgis::kernels::RepetitionPenalty(
          &t, Tensor::FromVector(distinct, {1, static_cast<int64_t>(distinct.size())}),
          Tensor::FromVector(std::vector<float>{penalty}, {1}));
      Tensor ids, lps;
      tgis::kernels::GreedyPick(&t, Tensor(), &ids, &lps);
      EXPECT_EQ(ids.data<int32_t>()[0], want.id) << "penalty " << penalty << " trial " << trial;
      EXPECT_NEAR(lps.data<float>()[0], want.logprob, 1e-5);
    }
  }
}

// A row that chooses from TopLogits' output (the engine's path: penalty and EOS ban applied
// where the logits are, then only the largest values read) makes Next's choice with Next's
// details, draw after draw from the same generator; when the values given do not reach far
// enough it says so, leaves the generator as it was, and Next on the penalized row (
// penalty_applied) makes the choice. Peaked and flat rows, ties, a banned EOS, every warper
// but typical_p, greedy with top-n; 16 and 1024 values given.
TEST(Sampler, ChoosingFromTheTopValuesChoosesWhatTheWholeRowChooses) {
  using tgis::kernels::Tensor;
  std::mt19937 gen(17);
  const int64_t v = 4000;
  const std::vector<int32_t> eos = {7};
  int from_top = 0, fell_back = 0;
  for (float spread : {6.0f, 1.0f, 0.0f}) {  // peaked, flatter, flat
    std::normal_distribution<float> normal(0.0f, spread > 0 ? spread : 1.0f);
    std::vector<float> logits(v);
    for (float& x : logits) x = spread > 0 ? normal(gen) : 0.5f;
    for (int64_t i = 0; i + 5 < v; i += 89) logits[i + 5] = logits[i];  // ties
    std::vector<int32_t> context = {3, 900, 901, 3};
    for (int top_k : {0, 3, 50}) {
      for (float top_p : {1.0f, 0.5f, 0.9f}) {
        for (float temperature : {1.0f, 0.7f}) {
          for (bool sample : {true, false}) {
            for (int64_t count : {int64_t{16}, int64_t{1024}}) {
              SamplingParams p;
              p.do_sample = sample;
              p.top_k = top_k;
              p.top_p = top_p;
              p.temperature = temperature;
              p.repetition_penalty = 1.3f;
              p.min_new_tokens = 2;  // EOS banned at generated 0 and 1
              p.seed = 5 + count;
              Sampler whole(p, eos), top(p, eos);
              const uint32_t top_n = sample ? 0 : 3;
              for (uint32_t generated = 0; generated < 6; ++generated) {
                std::vector<float> row = logits;
                const tgis::server::TokenChoice want = whole.Next(row, context, generated, top_n);
                const Sampler::DeviceSteps d = top.ForDevice(generated);
                ASSERT_TRUE(d.from_top);
                const float penalty = d.repetition_penalty, temp = d.temperature;
                const bool mask_eos = d.mask_eos;
                Tensor t = Tensor::FromVector(logits, {1, v});
                tgis::kernels::RepetitionPenalty(
                    &t, Tensor::FromVector(std::vector<int32_t>{3, 900, 901}, {1, 3}),
                    Tensor::FromVector(std::vector<float>{penalty}, {1}));
                if (mask_eos) t.data<float>()[eos[0]] = -std::numeric_limits<float>::infinity();
                Tensor values, ids, stats;
                tgis::kernels::TopLogits(t, Tensor::FromVector(std::vector<int32_t>{0}, {1}),
                                         Tensor::FromVector(std::vector<float>{temp}, {1}), count,
                                         &values, &ids, &stats);
                std::optional<tgis::server::TokenChoice> got =
                    top.NextFromTop(std::span<const float>(values.data<float>(), count),
                                    std::span<const int32_t>(ids.data<int32_t>(), count),
                                    stats.data<float>()[0], stats.data<float>()[1], v, top_n);
                if (got.has_value()) {
                  ++from_top;
                } else {
                  ++fell_back;
                  got = top.Next(std::span<float>(t.data<float>(), v), context, generated, top_n,
                                 std::nullopt, /*penalty_applied=*/true);
                }
                const std::string what =
                    "spread " + std::to_string(spread) + " top_k " + std::to_string(top_k) +
                    " top_p " + std::to_string(top_p) + " sample " + std::to_string(sample) +
                    " count " + std::to_string(count) + " step " + std::to_string(generated);
                ASSERT_EQ(got->id, want.id) << what;
                EXPECT_EQ(got->logprob, want.logprob) << what;
                EXPECT_EQ(got->rank, want.rank) << what;
                ASSERT_EQ(got->top.size(), want.top.size()) << what;
                for (size_t i = 0; i < want.top.size(); ++i) {
                  EXPECT_EQ(got->top[i].id, want.top[i].id) << what;
                  EXPECT_EQ(got->top[i].logprob, want.top[i].logprob) << what;
                }
              }
            }
          }
        }
      }
    }
  }
  // Both paths were taken.
  EXPECT_GT(from_top, 100);
  EXPECT_GT(fell_back, 10);
}

}  // namespace

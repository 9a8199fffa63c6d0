// Sampler: rejection sampling against a speculative draft keeps the sampling distribution.
// A statistical test with fixed seeds (deterministic, so it cannot flake): chi-square of the
// observed counts against the warped distribution computed here from its definition.
#include "server/sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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

}  // namespace

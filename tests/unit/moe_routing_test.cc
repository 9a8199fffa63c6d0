// RouteTokens: each token's k best experts and their weights, as transformers' Mixtral
// (softmax, top k, renormalized) and GraniteMoE (top k scores, softmax over them) compute them.
#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "server/moe.h"

namespace tgis::server {
namespace {

// Expert e's rows and weights, as pairs.
std::vector<std::pair<int32_t, float>> Taken(const std::vector<ExpertRows>& r, int e) {
  std::vector<std::pair<int32_t, float>> out;
  for (size_t i = 0; i < r[e].rows.size(); ++i) out.emplace_back(r[e].rows[i], r[e].weights[i]);
  return out;
}

TEST(MoeRoutingTest, EachTokenGoesToItsBestExpertsWithNormalizedWeights) {
  // Token 0 prefers experts 2 then 0; token 1 prefers 1 then 3.
  const std::vector<float> scores = {1.0f, -2.0f, 3.0f, 0.5f, -1.0f, 2.0f, 0.0f, 1.5f};
  for (ExpertRouting routing :
       {ExpertRouting::kSoftmaxTopKRenormalized, ExpertRouting::kTopKSoftmax}) {
    const auto r = RouteTokens(scores, 2, 4, 2, routing);
    ASSERT_EQ(r.size(), 4u);
    // Either way the two chosen weights are softmax over the two chosen scores.
    const float w0 = 1.0f / (1.0f + std::exp(1.0f - 3.0f));  // expert 2 over expert 0
    const float w1 = 1.0f / (1.0f + std::exp(1.5f - 2.0f));  // expert 1 over expert 3
    const auto e0 = Taken(r, 0), e1 = Taken(r, 1), e2 = Taken(r, 2), e3 = Taken(r, 3);
    ASSERT_EQ(e0.size(), 1u);
    ASSERT_EQ(e1.size(), 1u);
    ASSERT_EQ(e2.size(), 1u);
    ASSERT_EQ(e3.size(), 1u);
    EXPECT_EQ(e0[0].first, 0);
    EXPECT_EQ(e2[0].first, 0);
    EXPECT_EQ(e1[0].first, 1);
    EXPECT_EQ(e3[0].first, 1);
    EXPECT_NEAR(e2[0].second, w0, 1e-6);
    EXPECT_NEAR(e0[0].second, 1 - w0, 1e-6);
    EXPECT_NEAR(e1[0].second, w1, 1e-6);
    EXPECT_NEAR(e3[0].second, 1 - w1, 1e-6);
  }
}

// Qwen2-MoE's default (norm_topk_prob false): the chosen experts keep their probabilities
// over all experts, which sum to less than 1.
TEST(MoeRoutingTest, WithoutRenormalizationTheWeightsAreTheSoftmaxProbabilities) {
  const std::vector<float> scores = {1.0f, -2.0f, 3.0f, 0.5f};
  const auto r = RouteTokens(scores, 1, 4, 2, ExpertRouting::kSoftmaxTopK);
  double sum = 0;
  for (float v : scores) sum += std::exp(double{v});
  ASSERT_EQ(Taken(r, 2).size(), 1u);
  ASSERT_EQ(Taken(r, 0).size(), 1u);
  EXPECT_NEAR(Taken(r, 2)[0].second, std::exp(3.0) / sum, 1e-6);
  EXPECT_NEAR(Taken(r, 0)[0].second, std::exp(1.0) / sum, 1e-6);
  EXPECT_TRUE(r[1].rows.empty() && r[3].rows.empty());
}

TEST(MoeRoutingTest, TiesGoToTheLowerExpertAndOneExpertGetsWeightOne) {
  const std::vector<float> scores = {0.5f, 2.0f, 2.0f, 2.0f};
  const auto r = RouteTokens(scores, 1, 4, 1, ExpertRouting::kSoftmaxTopKRenormalized);
  EXPECT_EQ(Taken(r, 1), (std::vector<std::pair<int32_t, float>>{{0, 1.0f}}));
  EXPECT_TRUE(r[0].rows.empty() && r[2].rows.empty() && r[3].rows.empty());
}

// A row of scores with a NaN (a model that overflowed) still names k distinct experts in range;
// its weights are NaN, so that its logits turn NaN and that request alone fails.
TEST(MoeRoutingTest, ANanRowStillPicksDistinctExpertsWithNanWeights) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> scores = {nan, 1.0f, nan, 0.0f, /* next token */ 0.0f, 1.0f, 2.0f, 3.0f};
  for (ExpertRouting routing :
       {ExpertRouting::kSoftmaxTopKRenormalized, ExpertRouting::kTopKSoftmax}) {
    const auto r = RouteTokens(scores, 2, 4, 2, routing);
    int taken0 = 0;
    for (int e = 0; e < 4; ++e) {
      for (const auto& [row, w] : Taken(r, e)) {
        if (row == 0) {
          ++taken0;
          if (routing != ExpertRouting::kTopKSoftmax) {
            EXPECT_TRUE(std::isnan(w)) << e;
          }
        } else {
          EXPECT_TRUE(e == 2 || e == 3) << e;
          EXPECT_FALSE(std::isnan(w));
        }
      }
    }
    EXPECT_EQ(taken0, 2);
  }
}

}  // namespace
}  // namespace tgis::server

// Mixture-of-experts routing on the host: which experts each token of a step goes to, and with
// what weight, from the router's scores (CausalLM::MixtureOfExperts runs the experts).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tgis::server {

// How a router's scores become each token's experts and weights, in f32 as transformers
// computes them.
enum class ExpertRouting {
  kSoftmaxTopK,  // p = softmax(scores); the k largest p (Qwen2-MoE, norm_topk_prob false)
  kSoftmaxTopKRenormalized,  // the same, each divided by their sum (Mixtral; Qwen2-MoE's option)
  kTopKSoftmax,              // the k largest scores, then a softmax over those k (GraniteMoE)
};

// The rows of a step that one expert takes, ascending, and their weights.
struct ExpertRows {
  std::vector<int32_t> rows;
  std::vector<float> weights;
};

// Routes `tokens` rows of router scores ([tokens, experts] f32, row-major) to each row's `k`
// best experts (ties: the lower expert) as `routing` says. Returns one ExpertRows per expert. A row
// holding a NaN gets NaN weights (its logits turn NaN, which fails that request alone), never an
// expert out of range.
std::vector<ExpertRows> RouteTokens(std::span<const float> scores, int64_t tokens, int64_t experts,
                                    int64_t k, ExpertRouting routing);

}  // namespace tgis::server

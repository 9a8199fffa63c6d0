// Per-request next-token choice: logits processors (repetition penalty, TGIS length penalty,
// min_new_tokens), warpers (temperature, top-k, top-p, typical-p), greedy or seeded sampling,
// and the requested details (logprob, rank, top-n).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <vector>

namespace tgis::server {

class TokenConstraint;

struct SamplingParams {
  bool do_sample = false;
  float temperature = 1.0f;  // <= 0 or 1: none
  int top_k = 0;
  float top_p = 1.0f;
  float typical_p = 1.0f;
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;
  uint32_t length_penalty_start = 0;
  float length_penalty_decay = 0.0f;  // 0: none
  uint32_t min_new_tokens = 0;
};

struct TopToken {
  int32_t id;
  float logprob;
};

struct TokenChoice {
  int32_t id = 0;
  float logprob = 0;
  uint32_t rank = 1;
  std::vector<TopToken> top;  // the top_n most likely (more on ties), best first
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, std::vector<int32_t> eos_ids);
  ~Sampler();
  // Guided decoding: only the tokens `constraint` allows are chosen (the others' logits are
  // -inf before the warpers, so the details describe the constrained distribution, as vLLM's
  // guided-decoding logits processors gave them). Its choices go on the host (ForDevice says
  // neither greedy nor from_top). A constraint that must end lifts min_new_tokens' EOS ban.
  void SetConstraint(std::unique_ptr<TokenConstraint> constraint);
  bool constrained() const { return constraint_ != nullptr; }
  // Chooses the next token from `logits` (modified in place). `context` is every token so far
  // (prompt and generated) for the repetition penalty; `generated` counts generated tokens.
  //
  // `draft` (speculative decoding): a token proposed with certainty. Greedy choices ignore it
  // (the caller compares). Sampling accepts it with its probability p(draft) under the warped
  // distribution and otherwise samples from that distribution without it, renormalized: the
  // choice is distributed exactly as without a draft (rejection sampling against a point mass).
  // `penalty_applied`: the repetition penalty was applied where the logits were made (a row
  // NextFromTop could not finish). With a constraint that allows no token, the choice's id is
  // -1 (the caller fails the request).
  TokenChoice Next(std::span<float> logits, std::span<const int32_t> context, uint32_t generated,
                   uint32_t top_n, std::optional<int32_t> draft = std::nullopt,
                   bool penalty_applied = false);
  // What the device does before the next choice (Engine::PickOnDevice): the row gets
  // `repetition_penalty` (1: none) and, if `mask_eos`, its EOS ids banned, where it is. Then
  // `greedy`: the choice is a plain argmax of that row (no length penalty, no sampling); or
  // `from_top`: it can come from the row's largest values after TopLogits divides it by
  // `temperature` (1: none), through NextFromTop (no length penalty, no typical_p, which read
  // every token).
  struct DeviceSteps {
    bool mask_eos = false;
    float repetition_penalty = 1.0f;
    float temperature = 1.0f;
    bool greedy = false;
    bool from_top = false;
  };
  DeviceSteps ForDevice(uint32_t generated) const;
  // The choice Next would make (same warpers, same draw from the same generator, same details),
  // from TopLogits' output for the row: the `values` (tempered logits) and `ids` of its largest
  // entries, its log-sum-exp `lse` and probability `mass`, out of `vocab`. nullopt when those
  // are not enough (the warpers' walk, the draw or the top-n ties reach tokens not given); the
  // generator is then as it was, and the caller takes the whole row to Next. The sum a draw
  // scales by, without truncation, is `mass` rather than Next's own sum of the row: the same
  // to a few ulps.
  std::optional<TokenChoice> NextFromTop(std::span<const float> values,
                                         std::span<const int32_t> ids, float lse, float mass,
                                         int64_t vocab, uint32_t top_n);
  const std::vector<int32_t>& eos_ids() const { return eos_; }

 private:
  bool RepetitionPenalized() const;
  bool LengthPenalized(uint32_t generated) const;
  // A sampled token from log-probabilities `lp` after the warpers (top_k, top_p, typical_p),
  // the draft accepted or rejected first when there is one.
  int32_t Draw(const std::vector<float>& lp, std::optional<int32_t> draft);

  SamplingParams p_;
  std::vector<int32_t> eos_;
  std::mt19937_64 rng_;
  std::unique_ptr<TokenConstraint> constraint_;
};

// log_softmax of `logits` at every index (used for prompt logprobs too).
void LogSoftmaxInto(std::span<const float> logits, std::vector<float>* out);
// Rank (1 = best) and top-n (with ties) of `id` under `logprobs`.
void RankAndTop(std::span<const float> logprobs, int32_t id, uint32_t top_n, uint32_t* rank,
                std::vector<TopToken>* top);

}  // namespace tgis::server

// The waiting queue and its admission policy: which queued requests may join the running batch
// without the shards running out of KV cache, and without exceeding MAX_BATCH_SIZE.
// Not thread-safe: the batcher guards it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "router/request.h"

namespace tgis::router {

// A request's claim on the KV cache, looking forward: at the next step it holds `tokens`
// tokens, and it runs for at most `steps` more steps, holding one more token at each.
struct Footprint {
  uint32_t tokens = 0;
  uint32_t steps = 0;
};

// The footprint of a request that has generated `generated` of its tokens (0: not started),
// looking `lookahead` steps ahead at most (0: to the end of its run).
Footprint FootprintOf(const GenerationRequest& request, uint32_t generated, uint32_t lookahead = 0);

// The KV-cache tokens the requests would hold if none of them finished before the others: the
// sum of their final lengths in whole blocks, an upper bound of PeakTokens.
uint64_t FinalTokens(std::span<const Footprint> requests, uint32_t block_size);

// The most KV-cache tokens the requests hold together at any future step, counting whole
// blocks of `block_size` tokens (as the shards allocate them). A request frees its blocks when
// it finishes, so the peak is usually well below the sum of the requests' final lengths.
uint64_t PeakTokens(std::span<const Footprint> requests, uint32_t block_size);

struct AdmissionLimits {
  uint32_t max_batch_size = 12;
  uint64_t max_batch_tokens = 0;  // the KV cache, in tokens
  uint32_t block_size = 1;
  // TGIS's prefill weight limit: the most prompt tokens one prefill may carry, as the shards'
  // memory model says (0: none). As in TGIS it shrinks with the share of the KV cache the
  // running batch already holds.
  uint64_t max_prefill_tokens = 0;
  // TGIS's MAX_PREFILL_PADDING: the most padding, as a fraction of a prefill's tokens. Only a
  // shard that pads its batches to the longest prompt has any (`padded_batches`); ours are
  // ragged, so this refuses nothing unless the limit is below 0.
  double max_prefill_padding = 0.2;
  bool padded_batches = false;
  // 0: every request is admitted for its whole run, as TGIS does (the KV cache never runs out).
  // N > 0: for the next N steps only; when the cache runs out later, the shards preempt the
  // newest requests and the batcher resumes them (more requests run at once).
  uint32_t lookahead_steps = 0;
};

// What happened while a batch was chosen, for TGIS's queue metrics.
struct AdmissionStats {
  // Requests taken although an earlier one was skipped for not fitting (tgi_queue_jump).
  uint32_t queue_jumps = 0;
  // Requests taken that fit only because the batch's peak is counted step by step: the sum of
  // every request's final length would exceed the KV cache (tgi_granular_batch_addition).
  uint32_t granular_additions = 0;
  // Requests skipped because the prefill would be over its weight limit
  // (tgi_prefill_weight_limit_exceeded) or over its padding limit
  // (tgi_prefill_padding_limit_exceeded).
  uint32_t prefill_weight_exceeded = 0;
  uint32_t prefill_padding_exceeded = 0;
};

// The fraction of a prefill's tokens that is padding, for a shard that pads every prompt to the
// longest one (0 for ragged batches).
double PrefillPadding(std::span<const uint32_t> input_lengths, bool padded_batches);

class RequestQueue {
 public:
  void Push(std::unique_ptr<GenerationRequest> request);
  // Ahead of every waiting request (health checks).
  void PushFront(std::unique_ptr<GenerationRequest> request);
  size_t size() const { return queue_.size(); }
  bool empty() const { return queue_.empty(); }

  // Removes the requests whose client has gone and those past their time limit (the caller
  // answers those with TIME_LIMIT).
  struct Removed {
    std::vector<std::unique_ptr<GenerationRequest>> cancelled;
    std::vector<std::unique_ptr<GenerationRequest>> expired;
  };
  Removed RemoveCancelledAndExpired(Clock::time_point now);

  // The earliest time limit of a queued request.
  std::optional<Clock::time_point> EarliestDeadline() const;

  // Takes the requests for the next prefill, given the footprints of the running ones, or none
  // if fewer than `min_size` fit. Requests are taken in arrival order; one that does not fit
  // is skipped, and later ones may overtake it, but only those that arrived within
  // kOvertakeWindow after it, so that a large request is not starved by a stream of small ones.
  // `stats`, when given, gets what happened on the way.
  std::vector<std::unique_ptr<GenerationRequest>> NextBatch(std::span<const Footprint> running,
                                                            size_t min_size,
                                                            const AdmissionLimits& limits,
                                                            AdmissionStats* stats = nullptr);

  static constexpr std::chrono::milliseconds kOvertakeWindow{1000};

  std::unique_ptr<GenerationRequest> PopFront();
  std::vector<std::unique_ptr<GenerationRequest>> TakeAll();

 private:
  std::deque<std::unique_ptr<GenerationRequest>> queue_;
};

}  // namespace tgis::router

// The tgi_ metric set of TGIS's README, with its exact names, kinds and labels.
#pragma once

#include <cstdint>
#include <vector>

#include "metrics/registry.h"

namespace tgis::metrics {

// The limits TGIS derives its token-count and batch-size buckets from.
struct MetricShape {
  uint32_t max_sequence_length = 2048;
  uint32_t max_new_tokens = 1024;
  uint32_t max_batch_size = 12;
};

// TGIS's buckets (its router's server.rs): every *_duration histogram 0.0001 * 1.5^k seconds,
// k = 1..35; tokenize counts 2^6..2^19; input and total lengths 64 linear steps up to
// max_sequence_length, generated and max_new_tokens 64 up to max_new_tokens; batch sizes
// 1..max_batch_size.
std::vector<double> DurationBuckets();
std::vector<double> LinearBuckets(uint32_t limit);  // limit/64 * (1..64)

struct TgiMetrics {
  explicit TgiMetrics(Registry* r, const MetricShape& shape = {});
  // New buckets for the shape-dependent histograms, once the limits are known (before any of
  // them is observed: what they hold is dropped).
  void Reshape(const MetricShape& shape);

  // Requests (kind = "single" | "batch" | "stream").
  Family* request_count;        // counter{kind}
  Family* request_input_count;  // counter
  Family* request_failure;      // counter{err}
  Family* request_success;      // counter{stop_reason, kind}
  Family* request_max_new_tokens;
  Family* request_input_length;
  Family* request_raw_input_length;
  Family* request_mean_time_per_token_duration;
  Family* request_validation_duration;
  Family* request_queue_duration;
  Family* request_generated_tokens;
  Family* request_total_tokens;
  Family* request_duration;
  Family* request_inference_duration;
  // Batches (method = "prefill" | "next_token").
  Family* batch_concatenation_count;
  Family* batch_inference_count;             // counter{method}
  Family* batch_inference_success;           // counter{method}
  Family* batch_inference_failure;           // counter{method, reason}
  Family* batch_inference_batch_size;        // histogram{method}
  Family* batch_inference_duration;          // histogram{method, makeup}
  Family* batch_inference_forward_duration;  // histogram{method, makeup}
  Family* batch_inference_tokproc_duration;  // histogram{method, makeup}
  Family* batch_next_tokens;
  Family* batch_current_size;          // gauge
  Family* batch_input_tokens;          // gauge
  Family* batch_max_remaining_tokens;  // gauge
  Family* queue_size;                  // gauge
  Family* queue_jump;
  Family* granular_batch_addition;
  Family* prefill_weight_limit_exceeded;
  Family* prefill_padding_limit_exceeded;
  Family* prompt_load_failure;
  Family* prompt_load_duration;
  // Tokenize.
  Family* tokenize_request_count;
  Family* tokenize_request_input_count;
  Family* tokenize_request_tokens;
  Family* tokenize_request_duration;
  // Beyond TGIS, under our own prefix (tgis_): prefix caching.
  Family* prefix_cache_hits;           // counter: requests whose prompt started cached
  Family* prefix_cache_reused_tokens;  // counter: prompt tokens taken from the cache
  Family* preemptions;                 // counter: requests preempted (KV cache full)
  Family* draft_tokens;                // counter: speculative draft tokens verified
  Family* accepted_draft_tokens;       // counter: of them, accepted
};

}  // namespace tgis::metrics

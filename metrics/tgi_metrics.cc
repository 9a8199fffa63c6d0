#include "metrics/tgi_metrics.h"

namespace tgis::metrics {

std::vector<double> DurationBuckets() { return ExponentialBuckets(0.0001 * 1.5, 1.5, 35); }

std::vector<double> LinearBuckets(uint32_t limit) {
  std::vector<double> b;
  for (int x = 1; x <= 64; ++x) b.push_back(static_cast<double>(limit) / 64.0 * x);
  return b;
}

namespace {

std::vector<double> BatchSizeBuckets(uint32_t max_batch_size) {
  std::vector<double> b;
  for (uint32_t x = 1; x <= max_batch_size; ++x) b.push_back(x);
  return b;
}

}  // namespace

void TgiMetrics::Reshape(const MetricShape& shape) {
  request_input_length->SetBuckets(LinearBuckets(shape.max_sequence_length));
  request_total_tokens->SetBuckets(LinearBuckets(shape.max_sequence_length));
  request_generated_tokens->SetBuckets(LinearBuckets(shape.max_new_tokens));
  request_max_new_tokens->SetBuckets(LinearBuckets(shape.max_new_tokens));
  batch_inference_batch_size->SetBuckets(BatchSizeBuckets(shape.max_batch_size));
}

TgiMetrics::TgiMetrics(Registry* r, const MetricShape& shape) {
  const auto seconds = DurationBuckets();
  const auto tokens = LinearBuckets(shape.max_sequence_length);
  const auto new_tokens = LinearBuckets(shape.max_new_tokens);
  const auto sizes = BatchSizeBuckets(shape.max_batch_size);
  const auto tokenized = ExponentialBuckets(64, 2, 14);  // 2^6 .. 2^19
  request_count = r->Counter("tgi_request_count",
                             "Count of generate requests (batch of n counts as 1)", {"kind"});
  request_input_count = r->Counter("tgi_request_input_count",
                                   "Count of generate request inputs (batch of n counts as n)");
  request_failure = r->Counter("tgi_request_failure",
                               "Count of failed requests, segmented by error type", {"err"});
  request_success =
      r->Counter("tgi_request_success", "Count of successful requests", {"stop_reason", "kind"});
  request_max_new_tokens = r->Histogram("tgi_request_max_new_tokens",
                                        "Value of max_new_tokens request parameter", new_tokens);
  request_input_length =
      r->Histogram("tgi_request_input_length", "Request input length in tokens", tokens);
  request_raw_input_length =
      r->Summary("tgi_request_raw_input_length",
                 "Raw request input length in tokens (including too long validation failures)");
  request_mean_time_per_token_duration =
      r->Histogram("tgi_request_mean_time_per_token_duration",
                   "Mean time per token, per request (in seconds)", seconds);
  request_validation_duration = r->Histogram("tgi_request_validation_duration",
                                             "Request validation time (in seconds)", seconds);
  request_queue_duration = r->Histogram("tgi_request_queue_duration",
                                        "Request time spent in queue (in seconds)", seconds);
  request_generated_tokens = r->Histogram("tgi_request_generated_tokens",
                                          "Number of tokens generated for request", new_tokens);
  request_total_tokens =
      r->Histogram("tgi_request_total_tokens",
                   "Total sequence length of request (input tokens + generated tokens)", tokens);
  request_duration = r->Histogram("tgi_request_duration",
                                  "End-to-end generate request duration (in seconds)", seconds);
  request_inference_duration =
      r->Histogram("tgi_request_inference_duration",
                   "Duration of inferencing portion of request (in seconds)", seconds);
  batch_concatenation_count = r->Counter(
      "tgi_batch_concatenation_count",
      "How many times the continuous batcher combined a new batch into the running batch");
  batch_inference_count =
      r->Counter("tgi_batch_inference_count", "Count of model forward-pass iterations", {"method"});
  batch_inference_success =
      r->Counter("tgi_batch_inference_success", "Count of successful model forward-pass iterations",
                 {"method"});
  batch_inference_failure =
      r->Counter("tgi_batch_inference_failure", "Count of failed model forward-pass iterations",
                 {"method", "reason"});
  batch_inference_batch_size =
      r->Histogram("tgi_batch_inference_batch_size", "Batch size for each forward-pass iteration",
                   sizes, {"method"});
  batch_inference_duration = r->Histogram("tgi_batch_inference_duration",
                                          "Time taken for each forward-pass iteration (in seconds)",
                                          seconds, {"method", "makeup"});
  batch_inference_forward_duration =
      r->Histogram("tgi_batch_inference_forward_duration",
                   "Time taken for each model forward() method invocation (in seconds)", seconds,
                   {"method", "makeup"});
  batch_inference_tokproc_duration =
      r->Histogram("tgi_batch_inference_tokproc_duration",
                   "Token-processing time per model forward-pass iteration (in seconds)", seconds,
                   {"method", "makeup"});
  batch_next_tokens =
      r->Summary("tgi_batch_next_tokens",
                 "Total number of tokens included in prefill batch (including padding)");
  batch_current_size = r->Gauge("tgi_batch_current_size", "Current batch size");
  batch_input_tokens =
      r->Gauge("tgi_batch_input_tokens",
               "Total number of input tokens in current batch, including padding tokens");
  batch_max_remaining_tokens =
      r->Gauge("tgi_batch_max_remaining_tokens",
               "Maximum number of to-be-generated tokens of requests in current batch");
  queue_size = r->Gauge("tgi_queue_size", "Current number of queued requests");
  queue_jump = r->Counter("tgi_queue_jump", "Count of queue-jumps when batch filling");
  granular_batch_addition =
      r->Counter("tgi_granular_batch_addition",
                 "Count of batch additions due to granular analysis that would not otherwise fit");
  prefill_weight_limit_exceeded =
      r->Counter("tgi_prefill_weight_limit_exceeded",
                 "Count of times the max prefill weight is reached during new batch construction");
  prefill_padding_limit_exceeded = r->Counter(
      "tgi_prefill_padding_limit_exceeded",
      "Count of times the max prefill padding proportion is reached during new batch construction");
  prompt_load_failure =
      r->Counter("tgi_prompt_load_failure", "Count of failed tuned soft-prompt loads");
  prompt_load_duration = r->Histogram(
      "tgi_prompt_load_duration",
      "Time taken to JIT-load tuned soft-prompt in seconds (includes count of such loads)",
      seconds);
  tokenize_request_count = r->Counter("tgi_tokenize_request_count",
                                      "Count of tokenize requests (batch of n counts as 1)");
  tokenize_request_input_count =
      r->Counter("tgi_tokenize_request_input_count",
                 "Count of tokenize request inputs (batch of n counts as n)");
  tokenize_request_tokens = r->Histogram(
      "tgi_tokenize_request_tokens", "Count of tokenized tokens per tokenize request", tokenized);
  tokenize_request_duration = r->Histogram("tgi_tokenize_request_duration",
                                           "Tokenize request duration (in seconds)", seconds);
  prefix_cache_hits = r->Counter(
      "tgis_prefix_cache_hits_total",
      "Count of requests whose prompt started with KV cache blocks cached by earlier requests");
  prefix_cache_reused_tokens =
      r->Counter("tgis_prefix_cache_reused_tokens_total",
                 "Count of prompt tokens whose keys and values came from the prefix cache");
  preemptions = r->Counter("tgis_preemptions_total",
                           "Count of requests preempted because the KV cache was full (their "
                           "tokens are computed again when they resume)");
  draft_tokens =
      r->Counter("tgis_draft_tokens_total",
                 "Count of draft tokens verified by speculative decoding (prompt lookup)");
  accepted_draft_tokens =
      r->Counter("tgis_accepted_draft_tokens_total",
                 "Count of speculative draft tokens accepted: tokens greedy decoding chose anyway");
}

}  // namespace tgis::metrics

// Continuous batching: one background loop that admits queued requests into the running batch
// (a Prefill of the newcomers, whose cached batch then joins the next Decode), advances the
// batch one token per Decode, decides for every token whether its request is finished, and
// answers each request's sink. Finished and cancelled requests leave the shards' batch at the
// next step (their ids ride on the next Decode, or a FilterBatch before a Prefill).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "metrics/tgi_metrics.h"
#include "proto/generate.pb.h"
#include "router/queue.h"
#include "router/request.h"
#include "router/request_progress.h"
#include "router/shard_client.h"
#include "tokenizer/tokenizer.h"

namespace tgis::router {

struct BatcherConfig {
  AdmissionLimits admission;
  // Decode steps after which any queued request may interrupt decoding with its prefill;
  // before that, a prefill needs a number of waiting requests that shrinks with the steps.
  uint32_t max_waiting_tokens = 24;
  // Chunked prefill: the most prompt tokens one step computes (0: whole prompts in one
  // Prefill, as TGIS). The rest of a long prompt goes on in the next Decode steps, beside the
  // running requests' next tokens, so that their inter-token latency stays bounded.
  uint32_t prefill_chunk_tokens = 0;
  // Speculative decoding by prompt lookup: draft tokens the shards may verify per step for a
  // request (0: off). A step may then bring several tokens of one request.
  uint32_t speculate_tokens = 0;
  DetokenizationConfig detokenization;
  // Told whether the shards answer (false after a failed Prefill or Decode, true again after
  // one that worked); called from the batcher's thread when that changes.
  std::function<void(bool)> on_shard_health;
  // Told after every Prefill and Decode whether it worked (GET /health); batcher thread.
  std::function<void(bool)> on_generation_result;
  // The tgi_ metrics to keep up to date; none when null.
  metrics::TgiMetrics* metrics = nullptr;
};

class Batcher {
 public:
  // `shards` and `tokenizer` must outlive the batcher.
  Batcher(ShardClient& shards, const Tokenizer& tokenizer, BatcherConfig config);
  ~Batcher();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  void Start();
  // Answers every queued and running request with UNAVAILABLE and ends the loop.
  void Stop();

  // Queues requests together, in order (a batched Generate's inputs).
  void Enqueue(std::vector<std::unique_ptr<GenerationRequest>> requests);
  // Wakes the loop to look at the requests again (a client went away).
  void Notify();
  // Queues a one-token greedy generation ahead of the waiting requests (GET /health after a
  // failure); `done(ok)` is called once when it ends, from any thread.
  void EnqueueHealthCheck(std::function<void(bool)> done);

 private:
  struct Running {
    std::unique_ptr<GenerationRequest> request;
    std::unique_ptr<RequestProgress> progress;
    // The shards preempted it (KV cache full): in no cached batch, no blocks, waiting for
    // Resume.
    bool preempted = false;
    // Chunked prefill: admitted, its prompt not done, its first token still to come.
    bool prefilling = false;
  };

  void Loop();
  // Under mu_: the requests for the next prefill, if it is time for one.
  std::vector<std::unique_ptr<GenerationRequest>> TakeBatchLocked(Clock::time_point now);
  void AnswerRemoved(RequestQueue::Removed removed);
  void DropCancelled();
  void Prefill(std::vector<std::unique_ptr<GenerationRequest>> batch);
  // Sends a Prefill of new or resumed requests (`what` names it in the log) with the chunk
  // budget. Failed: its requests fail, its batch is cleared, nullopt. Answered: the requests
  // the shards refused fail and prefix-cache reuse is counted; the rest is the caller's.
  std::optional<generate::v1::PrefillResponse> CallPrefill(generate::v1::PrefillRequest* request,
                                                           const char* what,
                                                           Clock::time_point* start,
                                                           Clock::time_point* end);
  // Finished requests in none of the cached batches (they finished while preempted).
  std::vector<uint64_t> UnbatchedFinished() const;
  void Decode();
  // Resumes preempted requests, oldest first, as many as the KV cache holds again (at least
  // one when nothing else runs): a Prefill of resume requests.
  void Resume();
  bool AnyPreempted() const;
  bool AnyActive() const;  // running and not preempted
  // Frees the finished requests' KV blocks on the shards now (before a prefill needs them).
  void FilterFinished();
  void ReleaseIdleBatches();

  // Handles one generated token; the request may finish.
  void OnGeneration(const generate::v1::Generation& generation, bool prefill);
  void Finish(std::map<uint64_t, Running>::iterator it,
              absl::StatusOr<fmaas::GenerationResponse> last);
  void FailRequest(uint64_t id, const absl::Status& status);
  void FailAllRunning(const absl::Status& status);
  void SetShardHealth(bool healthy);
  // Answers a request (and records its metrics); every request ends here exactly once.
  void EndRequest(GenerationRequest& request, absl::StatusOr<fmaas::GenerationResponse> last,
                  uint32_t generated, bool expired_in_queue = false);
  // A forward pass ("prefill" or "next_token") returned: its metrics, and health.
  void OnInferenceDone(const char* method, const absl::Status& status, Clock::duration duration,
                       uint64_t forward_ns, Clock::duration tokproc);
  // Tracing: a step ("prefill", "resume", "decode") gets one router span, a root whose
  // children are the shards' spans of the step (its traceparent rides on the request); each
  // request in the step gets a span of the step under its own span, linked to the step's, with
  // a "detokenize" child for its token's handling here. Nothing happens while tracing is off.
  class StepTrace;
  void TraceRequestStep(const tracing::SpanContext& request_span, Clock::time_point handled);
  // tgi_batch_current_size, tgi_batch_input_tokens, tgi_batch_max_remaining_tokens.
  void UpdateBatchGauges();
  // Under mu_: tgi_queue_size.
  void UpdateQueueGaugeLocked();

  ShardClient& shards_;
  const Tokenizer& tokenizer_;
  const BatcherConfig config_;

  std::mutex mu_;
  std::condition_variable cv_;
  RequestQueue queue_;  // guarded by mu_
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;

  // The loop's own state (its thread only).
  std::map<uint64_t, Running> running_;
  std::vector<generate::v1::CachedBatch> batches_;  // the shards' batches for the next Decode
  std::vector<uint64_t> finished_;  // finished here, still holding KV blocks on the shards
  uint64_t next_batch_id_ = 1;
  tracing::Span step_span_;  // the step in progress (not recording between steps)
  const char* step_name_ = "";
  Clock::time_point step_start_{};
  uint32_t steps_since_prefill_ = 0;
  Clock::time_point next_prefill_after_{};
  bool shards_healthy_ = true;
  std::atomic<uint64_t> next_health_check_id_{uint64_t{1} << 63};  // apart from the service's
};

}  // namespace tgis::router

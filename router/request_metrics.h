// The tgi_ metrics of requests and batches, recorded where TGIS records them: a request's
// outcome when it ends (grpc_server.rs), a forward pass's when it returns (batcher.rs).
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "metrics/tgi_metrics.h"
#include "proto/generation.pb.h"
#include "router/request.h"

namespace tgis::router {

// TGIS's label for the composition of a forward pass's batch: it only has single sequences
// (beam search, which would make it "beam_only" or "mixed", does not exist).
inline constexpr char kBatchMakeup[] = "single_only";

// A request ended with `last` after `generated` tokens. Successes (any stop reason but
// CANCELLED) count in tgi_request_success{stop_reason,kind} with their durations and token
// counts; errors in tgi_request_failure{err="generate"}, cancellations in {err="cancelled"}.
// A request whose time limit passed while queued (`expired_in_queue`) counts as both
// {err="timeout"} and a TIME_LIMIT success, as in TGIS. Health checks count nowhere.
void RecordRequestEnd(metrics::TgiMetrics* m, const GenerationRequest& request,
                      const absl::StatusOr<fmaas::GenerationResponse>& last, uint32_t generated,
                      bool expired_in_queue, Clock::time_point now);

// tgi_batch_inference_failure's reason label: "oom", "connection" or "error".
const char* InferenceFailureReason(const absl::Status& status);

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace tgis::router

#include "router/request_metrics.h"

namespace tgis::router {

const char* KindLabel(RequestKind kind) {
  switch (kind) {
    case RequestKind::kSingle:
      return "single";
    case RequestKind::kBatch:
      return "batch";
    case RequestKind::kStream:
      return "stream";
    case RequestKind::kHealthCheck:
      return "health_check";
  }
  return "single";
}

void RecordRequestEnd(metrics::TgiMetrics* m, const GenerationRequest& request,
                      const absl::StatusOr<fmaas::GenerationResponse>& last, uint32_t generated,
                      bool expired_in_queue, Clock::time_point now) {
  if (m == nullptr || request.kind == RequestKind::kHealthCheck) return;
  if (!last.ok()) {
    m->request_failure->Add(
        1, {last.status().code() == absl::StatusCode::kCancelled ? "cancelled" : "generate"});
    return;
  }
  const fmaas::StopReason reason = last->stop_reason();
  if (reason == fmaas::CANCELLED) {
    m->request_failure->Add(1, {"cancelled"});
    return;
  }
  if (expired_in_queue) m->request_failure->Add(1, {"timeout"});
  m->request_success->Add(1, {fmaas::StopReason_Name(reason), KindLabel(request.kind)});
  m->request_duration->Observe(Seconds(now - request.received));
  m->request_generated_tokens->Observe(generated);
  m->request_total_tokens->Observe(request.input_length() + generated);
  // Inference runs from admission into the batch; a request that never got there has none.
  const Clock::duration inference = expired_in_queue || request.batched == Clock::time_point{}
                                        ? Clock::duration::zero()
                                        : now - request.batched;
  m->request_inference_duration->Observe(Seconds(inference));
  m->request_mean_time_per_token_duration->Observe(generated > 0 ? Seconds(inference) / generated
                                                                 : 0.0);
}

const char* InferenceFailureReason(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kResourceExhausted:
      return "oom";
    case absl::StatusCode::kUnavailable:
      return "connection";
    default:
      return "error";
  }
}

}  // namespace tgis::router

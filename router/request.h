// A validated generation request as it travels from the gRPC service through the queue and
// the batcher, and the sink its results go to.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/generation.pb.h"
#include "router/generation_params.h"
#include "tracing/tracing.h"

namespace tgis::router {

// Where a request's results go; implemented by the gRPC layer. Send and Finish are called from
// the batcher's thread, Cancelled from anywhere.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  // A partial response of a stream (never called for unary requests).
  virtual void Send(fmaas::GenerationResponse message) = 0;
  // The last message of a stream, the whole unary response, or the request's error. Called
  // exactly once per request, after which the sink is dropped.
  virtual void Finish(absl::StatusOr<fmaas::GenerationResponse> last) = 0;
  // True once the client is gone (cancelled, past its gRPC deadline, disconnected).
  virtual bool Cancelled() const = 0;
};

// Which call a request came from; its metrics carry it as the label kind (TGIS's "single",
// "batch" or "stream"). Health-check generations (GET /health) count in no request metric.
enum class RequestKind { kSingle, kBatch, kStream, kHealthCheck };
const char* KindLabel(RequestKind kind);

struct GenerationRequest {
  uint64_t id = 0;       // unique; also the request's id on the shards
  std::string log_name;  // names the request in logs (x-correlation-id when given)
  std::string input_text;
  std::vector<int32_t> input_ids;  // after truncation
  // Prompt tuning: the prefix's id (empty: none) and its virtual-token count, which the shards
  // put before the input.
  std::string prefix_id;
  uint32_t prefix_length = 0;
  GenerationParams params;
  bool streaming = false;
  // Prompt-lookup draft tokens per step for this request (x-speculate-tokens metadata); unset:
  // the server's SPECULATE.
  std::optional<uint32_t> speculate_tokens;
  RequestKind kind = RequestKind::kSingle;
  std::shared_ptr<ResponseSink> sink;
  Clock::time_point received{};
  Clock::time_point queued{};
  Clock::time_point batched{};  // admitted into the running batch (its prefill started)
  // Tracing (nothing recorded when it is off): the call's span, shared by a batched call's
  // requests and ended with the last of them, and this request's span under it, ended when
  // the request is answered. Steps, queue wait and validation are children of `span`.
  std::shared_ptr<tracing::Span> call_span;
  tracing::Span span;

  uint32_t input_length() const { return static_cast<uint32_t>(input_ids.size()); }
  // The prompt as the shards hold it: virtual tokens and input tokens.
  uint32_t prompt_length() const { return input_length() + prefix_length; }
};

}  // namespace tgis::router

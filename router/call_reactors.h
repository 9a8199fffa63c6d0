// The gRPC side of a generation call (callback API): each call is a reactor that the batcher
// reaches through ResponseSinks, so no thread waits on a request while it is queued or runs.
#pragma once

#include <grpcpp/grpcpp.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "proto/generation.pb.h"
#include "router/concurrency_limiter.h"
#include "router/request.h"

namespace tgis::router {

grpc::Status ToGrpcStatus(const absl::Status& status);

// Generate: each input runs as its own request; the call answers when all of them have, with
// the responses in input order, or with the first error (the other inputs are then cancelled).
class GenerateReactor final : public grpc::ServerUnaryReactor {
 public:
  // `on_cancel` is called when the client goes away or an input fails (to wake the batcher).
  // The reactor keeps the decoded request for the call's life; the response is encoded into
  // `wire_response` when the call ends.
  GenerateReactor(std::unique_ptr<fmaas::BatchedGenerationRequest> request,
                  grpc::ByteBuffer* wire_response, std::function<void()> on_cancel,
                  std::optional<ConcurrencyLimiter::Permit> permit);

  const fmaas::BatchedGenerationRequest& request() const { return *request_; }

  // One sink per input, in input order; called at most once, before the requests are queued.
  std::vector<std::shared_ptr<ResponseSink>> MakeSinks(size_t n);
  // Ends the call before any request was queued (validation failed, overload).
  void Fail(const absl::Status& status) { End(ToGrpcStatus(status)); }

  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  struct State;
  class Sink;

  // Frees the call's concurrency slots (its requests are done) and finishes the call.
  void End(const grpc::Status& status);

  std::unique_ptr<fmaas::BatchedGenerationRequest> request_;
  fmaas::BatchedGenerationResponse response_;
  grpc::ByteBuffer* wire_response_;  // owned by gRPC until the reactor is done
  std::shared_ptr<State> state_;
  std::optional<ConcurrencyLimiter::Permit> permit_;
};

// GenerateStream: messages are written one at a time, in order, as the batcher produces them.
class StreamReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // Keeps the decoded request (null for a call that fails before it has one) for the call's
  // life; messages are encoded as they are written.
  StreamReactor(std::unique_ptr<fmaas::SingleGenerationRequest> request,
                std::function<void()> on_cancel, std::optional<ConcurrencyLimiter::Permit> permit);

  const fmaas::SingleGenerationRequest& request() const { return *request_; }

  // The request's sink; the stream ends when the sink is finished.
  std::shared_ptr<ResponseSink> sink();
  // Queues a message (the first one is sent before the request is queued).
  void Push(fmaas::GenerationResponse message);
  // Ends the call before any request was queued.
  void Fail(const absl::Status& status);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  class Sink;
  friend class Sink;

  void Close(const grpc::Status& status);
  // Starts the next write, or the finish once everything is written; one at a time.
  void Pump();

  std::unique_ptr<fmaas::SingleGenerationRequest> request_;
  std::function<void()> on_cancel_;
  std::optional<ConcurrencyLimiter::Permit> permit_;  // guarded by mu_; freed on Close
  std::shared_ptr<Sink> sink_;

  std::mutex mu_;
  std::deque<fmaas::GenerationResponse> pending_;
  grpc::ByteBuffer in_flight_;
  bool writing_ = false;
  bool broken_ = false;  // a write failed: the client is gone
  std::optional<grpc::Status> final_status_;
  bool finished_ = false;
};

}  // namespace tgis::router

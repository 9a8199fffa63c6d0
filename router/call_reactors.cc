#include "router/call_reactors.h"

#include <atomic>

#include "router/request_decoding.h"

namespace tgis::router {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// ---------------------------------------------------------------------------------------------
// Generate

// Shared by the reactor and its inputs' sinks; outlives the reactor if inputs are still being
// cancelled after the call has ended.
struct GenerateReactor::State {
  std::mutex mu;
  GenerateReactor* reactor;                    // not to be used once `ended`
  fmaas::BatchedGenerationResponse* response;  // owned by gRPC until the reactor is done
  size_t remaining = 0;
  bool ended = false;
  std::atomic<bool> cancelled{false};
  std::function<void()> on_cancel;
};

class GenerateReactor::Sink final : public ResponseSink {
 public:
  Sink(std::shared_ptr<State> state, size_t index) : state_(std::move(state)), index_(index) {}

  void Send(fmaas::GenerationResponse) override {}  // unary: only Finish

  void Finish(absl::StatusOr<fmaas::GenerationResponse> last) override {
    GenerateReactor* end_call = nullptr;
    grpc::Status status;
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      --state_->remaining;
      if (state_->ended) return;
      if (last.ok()) {
        *state_->response->mutable_responses(static_cast<int>(index_)) = std::move(*last);
        if (state_->remaining == 0) {
          state_->ended = true;
          end_call = state_->reactor;
        }
      } else {
        // The first failed input fails the call; the others are of no use any more.
        state_->ended = true;
        end_call = state_->reactor;
        status = ToGrpcStatus(last.status());
        wake = state_->remaining > 0 && !state_->cancelled.exchange(true);
      }
    }
    if (wake) state_->on_cancel();
    if (end_call != nullptr) end_call->End(status);
  }

  bool Cancelled() const override { return state_->cancelled.load(); }

 private:
  std::shared_ptr<State> state_;
  size_t index_;
};

GenerateReactor::GenerateReactor(std::unique_ptr<fmaas::BatchedGenerationRequest> request,
                                 grpc::ByteBuffer* wire_response, std::function<void()> on_cancel,
                                 std::optional<ConcurrencyLimiter::Permit> permit)
    : request_(std::move(request)),
      wire_response_(wire_response),
      state_(std::make_shared<State>()),
      permit_(std::move(permit)) {
  state_->reactor = this;
  state_->response = &response_;
  state_->on_cancel = std::move(on_cancel);
}

std::vector<std::shared_ptr<ResponseSink>> GenerateReactor::MakeSinks(size_t n) {
  std::vector<std::shared_ptr<ResponseSink>> sinks;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->remaining = n;
  for (size_t i = 0; i < n; ++i) {
    state_->response->add_responses();
    sinks.push_back(std::make_shared<Sink>(state_, i));
  }
  return sinks;
}

void GenerateReactor::End(const grpc::Status& status) {
  // The slots are free as soon as the requests are done, not when gRPC is done with the call:
  // a client that sends its next request on receiving this response must find them free.
  permit_.reset();
  // Every sink has finished (or the call failed): nothing writes response_ any more.
  if (status.ok()) EncodeResponse(response_, wire_response_);
  Finish(status);
}

void GenerateReactor::OnCancel() {
  if (!state_->cancelled.exchange(true)) state_->on_cancel();
}

// ---------------------------------------------------------------------------------------------
// GenerateStream

class StreamReactor::Sink final : public ResponseSink {
 public:
  explicit Sink(StreamReactor* reactor) : reactor_(reactor) {}

  void Send(fmaas::GenerationResponse message) override { reactor_->Push(std::move(message)); }

  void Finish(absl::StatusOr<fmaas::GenerationResponse> last) override {
    if (last.ok()) {
      reactor_->Push(std::move(*last));
      reactor_->Close(grpc::Status::OK);
    } else {
      reactor_->Close(ToGrpcStatus(last.status()));
    }
  }

  bool Cancelled() const override { return cancelled_.load(); }
  // Returns true the first time.
  bool Cancel() { return !cancelled_.exchange(true); }

 private:
  // Valid until the reactor is done, which is only after Finish.
  StreamReactor* reactor_;
  std::atomic<bool> cancelled_{false};
};

StreamReactor::StreamReactor(std::unique_ptr<fmaas::SingleGenerationRequest> request,
                             std::function<void()> on_cancel,
                             std::optional<ConcurrencyLimiter::Permit> permit)
    : request_(std::move(request)),
      on_cancel_(std::move(on_cancel)),
      permit_(std::move(permit)),
      sink_(std::make_shared<Sink>(this)) {}

std::shared_ptr<ResponseSink> StreamReactor::sink() { return sink_; }

void StreamReactor::Push(fmaas::GenerationResponse message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_ || final_status_.has_value()) return;
    pending_.push_back(std::move(message));
  }
  Pump();
}

void StreamReactor::Fail(const absl::Status& status) { Close(ToGrpcStatus(status)); }

void StreamReactor::Close(const grpc::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (final_status_.has_value()) return;
    final_status_ = status;
    permit_.reset();  // the request is done; the slot is free before the last message goes
  }
  Pump();
}

void StreamReactor::Pump() {
  // gRPC allows one outstanding write; StartWrite and Finish are called without holding mu_,
  // since their completions may run on this thread.
  std::unique_lock<std::mutex> lock(mu_);
  if (writing_ || finished_) return;
  if (!pending_.empty() && !broken_) {
    EncodeResponse(pending_.front(), &in_flight_);
    pending_.pop_front();
    writing_ = true;
    lock.unlock();
    StartWrite(&in_flight_);
    return;
  }
  if (final_status_.has_value()) {
    finished_ = true;
    const grpc::Status status = *final_status_;
    lock.unlock();
    Finish(status);
  }
}

void StreamReactor::OnWriteDone(bool ok) {
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      broken_ = true;
      pending_.clear();
      cancel = true;
    }
  }
  if (cancel && sink_->Cancel()) on_cancel_();
  Pump();
}

void StreamReactor::OnCancel() {
  if (sink_->Cancel()) on_cancel_();
}

}  // namespace tgis::router

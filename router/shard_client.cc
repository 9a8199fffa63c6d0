#include "router/shard_client.h"

#include <glog/logging.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/generate.grpc.pb.h"

namespace tgis::router {
namespace {

namespace pb = generate::v1;
using Stub = pb::TextGenerationService::Stub;

absl::Status FromGrpc(const grpc::Status& s, size_t shard, bool name_shard = true) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(
      static_cast<absl::StatusCode>(s.error_code()),
      name_shard ? absl::StrCat("shard ", shard, ": ", s.error_message()) : s.error_message());
}

class GrpcShardClient final : public ShardClient {
 public:
  GrpcShardClient(std::vector<std::unique_ptr<Stub>> stubs, std::chrono::milliseconds step)
      : stubs_(std::move(stubs)), step_(step) {}

  absl::StatusOr<pb::InfoResponse> Info() override {
    return FanOut<pb::InfoResponse>(
        pb::InfoRequest(), kShortCall, /*wait_for_ready=*/true,
        [](auto* a, auto* c, auto* q, auto* r, auto done) { a->Info(c, q, r, std::move(done)); });
  }

  absl::Status Health() override {
    return FanOut<pb::HealthResponse>(pb::HealthRequest(), kShortCall, /*wait_for_ready=*/true,
                                      [](auto* a, auto* c, auto* q, auto* r, auto done) {
                                        a->Health(c, q, r, std::move(done));
                                      })
        .status();
  }

  absl::StatusOr<pb::WarmupResponse> Warmup(const pb::WarmupRequest& request) override {
    return FanOut<pb::WarmupResponse>(
        request, kNoDeadline, /*wait_for_ready=*/false,
        [](auto* a, auto* c, auto* q, auto* r, auto done) { a->Warmup(c, q, r, std::move(done)); });
  }

  absl::StatusOr<pb::PrefillResponse> Prefill(const pb::PrefillRequest& request) override {
    return FanOut<pb::PrefillResponse>(request, step_, /*wait_for_ready=*/false,
                                       [](auto* a, auto* c, auto* q, auto* r, auto done) {
                                         a->Prefill(c, q, r, std::move(done));
                                       });
  }

  absl::StatusOr<pb::DecodeResponse> Decode(const pb::DecodeRequest& request) override {
    return FanOut<pb::DecodeResponse>(
        request, step_, /*wait_for_ready=*/false,
        [](auto* a, auto* c, auto* q, auto* r, auto done) { a->Decode(c, q, r, std::move(done)); });
  }

  absl::StatusOr<pb::FilterBatchResponse> FilterBatch(
      const pb::FilterBatchRequest& request) override {
    return FanOut<pb::FilterBatchResponse>(request, step_, /*wait_for_ready=*/false,
                                           [](auto* a, auto* c, auto* q, auto* r, auto done) {
                                             a->FilterBatch(c, q, r, std::move(done));
                                           });
  }

  absl::StatusOr<uint32_t> PrefixLookup(const std::string& prefix_id) override {
    pb::PrefixLookupRequest request;
    request.set_prefix_id(prefix_id);
    // TGIS's PREFIX_LOOKUP_TIMEOUT; the shard's message goes to the client as it is.
    auto response = FanOut<pb::PrefixLookupResponse>(
        request, kPrefixLookup, /*wait_for_ready=*/true,
        [](auto* a, auto* c, auto* q, auto* r, auto done) {
          a->PrefixLookup(c, q, r, std::move(done));
        },
        /*name_shard=*/false);
    if (!response.ok()) return response.status();
    return response->prefix_length();
  }

  absl::Status ClearCache(std::optional<uint64_t> batch_id) override {
    pb::ClearCacheRequest request;
    if (batch_id.has_value()) request.set_id(*batch_id);
    return FanOut<pb::ClearCacheResponse>(request, step_, /*wait_for_ready=*/false,
                                          [](auto* a, auto* c, auto* q, auto* r, auto done) {
                                            a->ClearCache(c, q, r, std::move(done));
                                          })
        .status();
  }

 private:
  static constexpr std::chrono::milliseconds kShortCall{1000};
  static constexpr std::chrono::milliseconds kNoDeadline{0};
  static constexpr std::chrono::milliseconds kPrefixLookup{5000};

  // Sends `request` to every shard at once and waits for all of them; shard 0's response
  // wins, and any shard's failure fails the call.
  template <typename Response, typename Request, typename Start>
  // `wait_for_ready`: wait for a reconnecting channel within the deadline rather than fail at
  // once (steps fail at once: a shard that is gone is an error, not something to wait for).
  absl::StatusOr<Response> FanOut(const Request& request, std::chrono::milliseconds deadline,
                                  bool wait_for_ready, Start start, bool name_shard = true) {
    struct Call {
      grpc::ClientContext context;
      Response response;
      grpc::Status status;
    };
    std::vector<Call> calls(stubs_.size());
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = calls.size();
    for (size_t i = 0; i < calls.size(); ++i) {
      if (deadline.count() > 0) {
        calls[i].context.set_wait_for_ready(wait_for_ready);
        calls[i].context.set_deadline(std::chrono::system_clock::now() + deadline);
      }
      start(stubs_[i]->async(), &calls[i].context, &request, &calls[i].response,
            [&, i](grpc::Status status) {
              std::lock_guard<std::mutex> lock(mu);
              calls[i].status = std::move(status);
              if (--pending == 0) cv.notify_all();
            });
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return pending == 0; });
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!calls[i].status.ok()) return FromGrpc(calls[i].status, i, name_shard);
    }
    return std::move(calls[0].response);
  }

  std::vector<std::unique_ptr<Stub>> stubs_;
  std::chrono::milliseconds step_;  // 0: no deadline
};

}  // namespace

absl::StatusOr<std::unique_ptr<ShardClient>> ConnectShards(const std::string& uds_path,
                                                           int num_shards,
                                                           std::chrono::seconds timeout,
                                                           std::chrono::seconds step_timeout) {
  if (num_shards < 1) return absl::InvalidArgumentError("--num-shard must be at least 1");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  // A shard that is not up yet is retried often; gRPC's default backoff waits up to 2 minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::vector<std::unique_ptr<Stub>> stubs;
  for (int i = 0; i < num_shards; ++i) {
    const std::string target = absl::StrCat("unix://", uds_path, "-", i);
    stubs.push_back(pb::TextGenerationService::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
  }
  auto client = std::make_unique<GrpcShardClient>(
      std::move(stubs), std::chrono::duration_cast<std::chrono::milliseconds>(step_timeout));
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  auto next_log = std::chrono::steady_clock::now();
  for (;;) {
    absl::Status health = client->Health();
    if (health.ok()) break;
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up) {
      return absl::UnavailableError(absl::StrCat("the shards at unix://", uds_path,
                                                 "-N did not answer within ", timeout.count(),
                                                 "s: ", health.message()));
    }
    if (now >= next_log) {
      LOG(INFO) << "waiting for " << num_shards << " shard(s) at unix://" << uds_path
                << "-N: " << health.message();
      next_log = now + std::chrono::seconds(10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return client;
}

}  // namespace tgis::router

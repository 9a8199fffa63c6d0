// fmaas.GenerationService: validates and tokenizes requests, hands them to the batcher, and
// answers Tokenize and ModelInfo itself.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "metrics/tgi_metrics.h"
#include "proto/generation.grpc.pb.h"
#include "router/batcher.h"
#include "router/concurrency_limiter.h"
#include "router/validation.h"
#include "router/work_pool.h"
#include "tokenizer/tokenizer.h"

namespace tgis::router {

struct ServiceOptions {
  ValidationLimits limits;
  uint32_t max_concurrent_requests = 512;
  fmaas::ModelInfoResponse::ModelKind model_kind = fmaas::ModelInfoResponse::DECODER_ONLY;
  // The tgi_ metrics to keep up to date; none when null. Must outlive the service.
  metrics::TgiMetrics* metrics = nullptr;
  // Loads a prompt-tuning prefix on the shards and gives its virtual-token count; unset: every
  // prefix id fails as not found.
  std::function<absl::StatusOr<uint32_t>(const std::string&)> prefix_lookup;
};

// A request gRPC cannot parse (random bytes, invalid UTF-8 in a string field) never reaches
// these handlers: gRPC C++ answers it itself, UNIMPLEMENTED with no details (measured with
// grpcio sending raw bytes). Answering INVALID_ARGUMENT with the reason would take raw
// (ByteBuffer) methods that parse and serialize themselves, reactors included: issue 13.
class GenerationService final : public fmaas::GenerationService::CallbackService {
 public:
  // `tokenizer` and `batcher` must outlive the service.
  GenerationService(const Tokenizer& tokenizer, Batcher& batcher, ServiceOptions options);

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const fmaas::BatchedGenerationRequest* request,
                                     fmaas::BatchedGenerationResponse* response) override;
  grpc::ServerWriteReactor<fmaas::GenerationResponse>* GenerateStream(
      grpc::CallbackServerContext* context, const fmaas::SingleGenerationRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const fmaas::BatchedTokenizeRequest* request,
                                     fmaas::BatchedTokenizeResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfo(grpc::CallbackServerContext* context,
                                      const fmaas::ModelInfoRequest* request,
                                      fmaas::ModelInfoResponse* response) override;

 private:
  // Validates the parameters and every input, all or nothing, into requests ready to queue.
  absl::StatusOr<std::vector<std::unique_ptr<GenerationRequest>>> Prepare(
      const std::optional<std::string>& prefix_id, const fmaas::Parameters* params,
      const std::vector<const std::string*>& texts, RequestKind kind, const std::string& log_name,
      Clock::time_point received);
  // The prefix's virtual-token count: from the cache of lengths, else looked up on the shards
  // (TGIS keeps 256 for an hour; failures are not kept).
  absl::StatusOr<uint32_t> PrefixLength(const std::string& prefix_id);
  // Runs a call's preparation (tokenization, validation, queueing) now, or on prepare_pool_
  // when its inputs are large.
  void PrepareOn(size_t input_bytes, std::function<void()> work);
  // A call refused before validation (overload) or by validation.
  void CountFailure(const char* err);

  const Tokenizer& tokenizer_;
  Batcher& batcher_;
  const ServiceOptions options_;
  ConcurrencyLimiter limiter_;
  std::mutex prefix_mu_;
  std::map<std::string, std::pair<uint32_t, Clock::time_point>> prefix_lengths_;
  std::atomic<uint64_t> next_id_{1};    // requests (each input of a call)
  std::atomic<uint64_t> next_call_{1};  // calls, to name them in logs
  // Tokenization, validation and prefix lookups of Generate and GenerateStream calls (last:
  // destroyed first, so its work finishes while the members it uses are alive).
  WorkPool prepare_pool_{2};
};

}  // namespace tgis::router

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

// Every method is raw (it receives and sends bytes) so that a request protobuf cannot parse
// (random bytes, invalid UTF-8 in a string field) is answered INVALID_ARGUMENT saying what is
// wrong (DecodeRequest); gRPC C++ would answer it UNIMPLEMENTED, without a word, before any
// handler ran.
using RawGenerationService = fmaas::GenerationService::WithRawCallbackMethod_Generate<
    fmaas::GenerationService::WithRawCallbackMethod_GenerateStream<
        fmaas::GenerationService::WithRawCallbackMethod_Tokenize<
            fmaas::GenerationService::WithRawCallbackMethod_ModelInfo<
                fmaas::GenerationService::Service>>>>;

class GenerationService final : public RawGenerationService {
 public:
  // `tokenizer` and `batcher` must outlive the service.
  GenerationService(const Tokenizer& tokenizer, Batcher& batcher, ServiceOptions options);

  // The typed (synchronous) forms stay declared in the base, never called.
  using RawGenerationService::Generate;
  using RawGenerationService::GenerateStream;
  using RawGenerationService::ModelInfo;
  using RawGenerationService::Tokenize;

  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* wire_request,
                                     grpc::ByteBuffer* wire_response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerateStream(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* wire_request,
                                     grpc::ByteBuffer* wire_response) override;
  grpc::ServerUnaryReactor* ModelInfo(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* wire_request,
                                      grpc::ByteBuffer* wire_response) override;

 private:
  // Validates the parameters and every input, all or nothing, into requests ready to queue.
  absl::StatusOr<std::vector<std::unique_ptr<GenerationRequest>>> Prepare(
      const std::optional<std::string>& prefix_id, const fmaas::Parameters* params,
      const std::vector<const std::string*>& texts, RequestKind kind, const std::string& log_name,
      Clock::time_point received, std::shared_ptr<tracing::Span> call_span);
  // A call whose inputs failed Prepare: its span's error, the failure metric and the log line
  // (the caller fails the call with `status`).
  void RecordInvalid(const absl::Status& status, const std::string& log_name,
                     tracing::Span& call_span);
  // The prefix's virtual-token count: from the cache of lengths, else looked up on the shards
  // (TGIS keeps 256 for an hour; failures are not kept).
  absl::StatusOr<uint32_t> PrefixLength(const std::string& prefix_id);
  // Runs a call's preparation (tokenization, validation, queueing) now, or on prepare_pool_
  // when its inputs are large.
  void PrepareOn(size_t input_bytes, std::function<void()> work);
  // A call refused before validation (overload) or by validation.
  void CountFailure(const char* err);
  // Tokenize's answer, or the first input's tokenizer error.
  absl::StatusOr<fmaas::BatchedTokenizeResponse> TokenizeAll(
      const fmaas::BatchedTokenizeRequest& request);

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

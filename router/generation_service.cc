#include "router/generation_service.h"

#include <glog/logging.h>

#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "router/call_reactors.h"
#include "router/input_encoding.h"
#include "router/request_decoding.h"
#include "router/request_metrics.h"
#include "router/request_progress.h"

namespace tgis::router {
namespace {

constexpr char kOverloaded[] = "Model is overloaded";

uint32_t RandomSeed() {
  thread_local std::mt19937 rng{std::random_device{}()};
  return static_cast<uint32_t>(rng());
}

// Names the call in logs: the client's x-correlation-id when it sent one.
std::string CallName(const grpc::CallbackServerContext* context, uint64_t call_number) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("x-correlation-id");
  if (it != metadata.end()) {
    return "correlation id " + std::string(it->second.data(), it->second.size());
  }
  return absl::StrCat("call ", call_number);
}

// The call's span ("generate" or "generate_stream", as TGIS's router names them), a child of
// the client's trace when its metadata carries a W3C traceparent.
std::shared_ptr<tracing::Span> CallSpan(const grpc::CallbackServerContext* context,
                                        const char* name, Clock::time_point received,
                                        const std::string& call_name) {
  if (!tracing::TracingEnabled()) return std::make_shared<tracing::Span>();
  const auto& metadata = context->client_metadata();
  std::optional<tracing::SpanContext> parent;
  if (auto it = metadata.find("traceparent"); it != metadata.end()) {
    parent = tracing::SpanContext::FromTraceparent(
        std::string_view(it->second.data(), it->second.size()));
  }
  auto span = std::make_shared<tracing::Span>(
      tracing::StartSpan(name, parent ? &*parent : nullptr, tracing::SpanKind::kServer, received));
  span->SetAttribute("rpc.system", "grpc");
  span->SetAttribute("rpc.service", "fmaas.GenerationService");
  span->SetAttribute("call", call_name);
  return span;
}

// Ours, beyond TGIS's API: the gRPC metadata "x-speculate-tokens: N" sets a request's
// prompt-lookup speculation (0 turns it off), whatever the server's SPECULATE says.
constexpr char kSpeculateHeader[] = "x-speculate-tokens";
constexpr uint32_t kMaxSpeculateTokens = 64;  // as --speculate
absl::StatusOr<std::optional<uint32_t>> SpeculateOverride(
    const grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(kSpeculateHeader);
  if (it == metadata.end()) return std::nullopt;
  const std::string value(it->second.data(), it->second.size());
  uint32_t n = 0;
  if (!absl::SimpleAtoi(value, &n) || n > kMaxSpeculateTokens) {
    return absl::InvalidArgumentError(absl::StrCat(kSpeculateHeader, " must be an integer in [0, ",
                                                   kMaxSpeculateTokens, "], not '", value, "'"));
  }
  return n;
}

absl::Status TokenizerError(const absl::Status& status) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer error ", status.message()));
}

// The prompt-tuning prefix a request selects: the vllm-tgis-adapter's adapter_id when set and
// non-empty (its rule), else TGIS's prefix_id when present (an empty one is looked up, and fails,
// as in TGIS).
template <typename Request>
std::optional<std::string> SelectedPrefix(const Request& request) {
  if (request.has_adapter_id() && !request.adapter_id().empty()) return request.adapter_id();
  if (request.has_prefix_id()) return request.prefix_id();
  return std::nullopt;
}

}  // namespace

GenerationService::GenerationService(const Tokenizer& tokenizer, Batcher& batcher,
                                     ServiceOptions options)
    : tokenizer_(tokenizer),
      batcher_(batcher),
      options_(std::move(options)),
      limiter_(options_.max_concurrent_requests) {}

void GenerationService::RecordInvalid(const absl::Status& status, const std::string& log_name,
                                      tracing::Span& call_span) {
  call_span.SetError(std::string(status.message()));
  CountFailure("validation");
  LOG(WARNING) << log_name << ": " << status.message();
}

absl::StatusOr<std::vector<std::unique_ptr<GenerationRequest>>> GenerationService::Prepare(
    const std::optional<std::string>& prefix_id, const fmaas::Parameters* params,
    const std::vector<const std::string*>& texts, RequestKind kind, const std::string& log_name,
    Clock::time_point received, std::shared_ptr<tracing::Span> call_span) {
  metrics::TgiMetrics* m = options_.metrics;
  absl::StatusOr<GenerationParams> converted = ConvertParameters(params, options_.limits, received);
  if (!converted.ok()) return converted.status();
  uint32_t prefix_length = 0;
  if (prefix_id.has_value()) {
    absl::StatusOr<uint32_t> length = PrefixLength(*prefix_id);
    if (!length.ok()) return PromptPrefixError(*prefix_id, length.status());
    prefix_length = *length;
  }

  std::vector<std::unique_ptr<GenerationRequest>> requests;
  for (size_t i = 0; i < texts.size(); ++i) {
    auto r = std::make_unique<GenerationRequest>();
    r->id = next_id_.fetch_add(1);
    r->log_name =
        texts.size() == 1 ? log_name : absl::StrCat(log_name, " [", i + 1, "/", texts.size(), "]");
    r->input_text = *texts[i];
    if (prefix_id.has_value()) r->prefix_id = *prefix_id;
    r->prefix_length = prefix_length;
    r->params = *converted;
    r->streaming = kind == RequestKind::kStream;
    r->kind = kind;
    r->received = received;
    r->call_span = call_span;
    r->span = tracing::StartSpan("request", &call_span->context(), tracing::SpanKind::kInternal,
                                 received);
    r->span.SetAttribute("request.id", static_cast<int64_t>(r->id));
    tracing::Span validate = tracing::StartSpan("validate", &r->span.context());
    // An input that cannot fit whatever its exact length (no truncation asked for) is
    // refused from a prefix of it when it is far too long to be worth tokenizing whole.
    if (r->params.truncate_input_tokens == 0 &&
        prefix_length < options_.limits.max_sequence_length) {
      if (std::optional<size_t> at_least = TokensOfLongPrefix(
              tokenizer_, r->input_text, options_.limits.max_sequence_length - prefix_length)) {
        if (m != nullptr) m->request_raw_input_length->Observe(static_cast<double>(*at_least));
        return InputTooLong(*at_least, prefix_length, options_.limits);
      }
    }
    size_t raw_length = 0;
    absl::StatusOr<Encoding> encoding =
        EncodeInput(tokenizer_, r->input_text, r->params.truncate_input_tokens, &raw_length);
    if (!encoding.ok()) return TokenizerError(encoding.status());
    // Before truncation, and also for inputs that then fail validation as too long.
    if (m != nullptr) m->request_raw_input_length->Observe(static_cast<double>(raw_length));
    r->input_ids = std::move(encoding->ids);
    absl::Status valid =
        ValidateInput(r->input_length(), prefix_length, options_.limits, RandomSeed(), &r->params);
    if (!valid.ok()) return valid;
    r->span.SetAttribute("input_tokens", static_cast<int64_t>(r->input_length()));
    r->span.SetAttribute("max_new_tokens", static_cast<int64_t>(r->params.max_new_tokens));
    validate.End();
    requests.push_back(std::move(r));
  }
  if (m != nullptr) {
    // Only for calls that passed validation; max_new_tokens as asked (before any lowering to
    // fit max_sequence_length).
    for (const auto& r : requests) {
      m->request_input_length->Observe(r->input_length());
      m->request_max_new_tokens->Observe(converted->max_new_tokens);
    }
    m->request_validation_duration->Observe(Seconds(Clock::now() - received));
  }
  return requests;
}

absl::StatusOr<uint32_t> GenerationService::PrefixLength(const std::string& prefix_id) {
  constexpr size_t kCapacity = 256;
  constexpr auto kTimeToLive = std::chrono::hours(1);
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(prefix_mu_);
    auto it = prefix_lengths_.find(prefix_id);
    if (it != prefix_lengths_.end() && now - it->second.second < kTimeToLive) {
      return it->second.first;
    }
  }
  metrics::TgiMetrics* m = options_.metrics;
  absl::StatusOr<uint32_t> length =
      options_.prefix_lookup
          ? options_.prefix_lookup(prefix_id)
          : absl::NotFoundError(absl::StrCat("prefix id \"", prefix_id, "\" not found"));
  if (!length.ok()) {
    if (m != nullptr) m->prompt_load_failure->Add(1);
    return length.status();
  }
  if (m != nullptr) m->prompt_load_duration->Observe(Seconds(Clock::now() - now));
  std::lock_guard<std::mutex> lock(prefix_mu_);
  if (prefix_lengths_.size() >= kCapacity) {
    // Full: the entry loaded longest ago goes.
    auto oldest = prefix_lengths_.begin();
    for (auto it = prefix_lengths_.begin(); it != prefix_lengths_.end(); ++it) {
      if (it->second.second < oldest->second.second) oldest = it;
    }
    prefix_lengths_.erase(oldest);
  }
  prefix_lengths_[prefix_id] = {*length, now};
  return *length;
}

void GenerationService::PrepareOn(size_t input_bytes, std::function<void()> work) {
  // Small inputs tokenize in well under a millisecond: on the calling thread, never behind a
  // large one. Large inputs go to the pool, off the threads that accept calls.
  constexpr size_t kInlineBytes = 64 << 10;
  if (input_bytes <= kInlineBytes) {
    work();
  } else {
    prepare_pool_.Post(std::move(work));
  }
}

void GenerationService::CountFailure(const char* err) {
  if (options_.metrics != nullptr) options_.metrics->request_failure->Add(1, {err});
}

namespace {

// A unary call whose request could not be decoded.
grpc::ServerUnaryReactor* RefuseUndecodable(grpc::CallbackServerContext* context,
                                            const absl::Status& status) {
  LOG(WARNING) << context->peer() << ": " << status.message();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* GenerationService::Generate(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire_request,
                                                      grpc::ByteBuffer* wire_response) {
  const Clock::time_point received = Clock::now();
  auto decoded = std::make_unique<fmaas::BatchedGenerationRequest>();
  if (absl::Status st = DecodeRequest(*wire_request, decoded.get()); !st.ok()) {
    return RefuseUndecodable(context, st);
  }
  const size_t n = static_cast<size_t>(decoded->requests_size());
  auto on_cancel = [this] { batcher_.Notify(); };
  metrics::TgiMetrics* m = options_.metrics;
  if (m != nullptr) m->request_count->Add(1, {n == 1 ? "single" : "batch"});
  if (n == 0) {
    auto* reactor = new GenerateReactor(std::move(decoded), wire_response, on_cancel, std::nullopt);
    reactor->Fail(absl::OkStatus());  // ends the call: OK, with no responses
    return reactor;
  }
  if (m != nullptr) m->request_input_count->Add(static_cast<double>(n));
  const std::string name = CallName(context, next_call_.fetch_add(1));
  std::optional<ConcurrencyLimiter::Permit> permit = limiter_.TryAcquire(static_cast<uint32_t>(n));
  const bool admitted = permit.has_value();
  auto* reactor =
      new GenerateReactor(std::move(decoded), wire_response, on_cancel, std::move(permit));
  if (!admitted) {
    CountFailure("conc_limit");
    LOG(ERROR) << name << ": " << kOverloaded;
    reactor->Fail(absl::ResourceExhaustedError(kOverloaded));
    return reactor;
  }
  const absl::StatusOr<std::optional<uint32_t>> speculate = SpeculateOverride(context);
  if (!speculate.ok()) {
    CountFailure("validation");
    reactor->Fail(speculate.status());
    return reactor;
  }
  const fmaas::BatchedGenerationRequest* request = &reactor->request();
  size_t bytes = 0;
  for (const fmaas::GenerationRequest& r : request->requests()) bytes += r.text().size();
  auto call_span = CallSpan(context, "generate", received, name);
  // `request` lives until the call is finished, which is not before this work is done.
  PrepareOn(bytes, [this, request, reactor, name, received, n, call_span, speculate] {
    std::vector<const std::string*> texts;
    for (const fmaas::GenerationRequest& r : request->requests()) texts.push_back(&r.text());
    auto requests = Prepare(
        SelectedPrefix(*request), request->has_params() ? &request->params() : nullptr, texts,
        n == 1 ? RequestKind::kSingle : RequestKind::kBatch, name, received, call_span);
    if (!requests.ok()) {
      RecordInvalid(requests.status(), name, *call_span);
      reactor->Fail(requests.status());
      return;
    }
    std::vector<std::shared_ptr<ResponseSink>> sinks = reactor->MakeSinks(n);
    for (size_t i = 0; i < n; ++i) {
      (*requests)[i]->sink = std::move(sinks[i]);
      (*requests)[i]->speculate_tokens = *speculate;
    }
    batcher_.Enqueue(std::move(*requests));
  });
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::GenerateStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* wire_request) {
  const Clock::time_point received = Clock::now();
  auto decoded = std::make_unique<fmaas::SingleGenerationRequest>();
  if (absl::Status st = DecodeRequest(*wire_request, decoded.get()); !st.ok()) {
    LOG(WARNING) << context->peer() << ": " << st.message();
    auto* reactor = new StreamReactor(
        nullptr, [] {}, std::nullopt);
    reactor->Fail(st);
    return reactor;
  }
  const std::string name = CallName(context, next_call_.fetch_add(1));
  if (options_.metrics != nullptr) {
    options_.metrics->request_count->Add(1, {"stream"});
    options_.metrics->request_input_count->Add(1);
  }
  std::optional<ConcurrencyLimiter::Permit> permit = limiter_.TryAcquire(1);
  const bool admitted = permit.has_value();
  auto* reactor = new StreamReactor(
      std::move(decoded), [this] { batcher_.Notify(); }, std::move(permit));
  if (!admitted) {
    CountFailure("conc_limit");
    LOG(ERROR) << name << ": " << kOverloaded;
    reactor->Fail(absl::ResourceExhaustedError(kOverloaded));
    return reactor;
  }
  const absl::StatusOr<std::optional<uint32_t>> speculate = SpeculateOverride(context);
  if (!speculate.ok()) {
    CountFailure("validation");
    reactor->Fail(speculate.status());
    return reactor;
  }
  const fmaas::SingleGenerationRequest* request = &reactor->request();
  if (!request->has_request()) {
    reactor->Fail(absl::InvalidArgumentError("missing request"));
    return reactor;
  }
  auto call_span = CallSpan(context, "generate_stream", received, name);
  PrepareOn(request->request().text().size(),
            [this, request, reactor, name, received, call_span, speculate] {
              auto requests = Prepare(
                  SelectedPrefix(*request), request->has_params() ? &request->params() : nullptr,
                  {&request->request().text()}, RequestKind::kStream, name, received, call_span);
              if (!requests.ok()) {
                RecordInvalid(requests.status(), name, *call_span);
                reactor->Fail(requests.status());
                return;
              }
              GenerationRequest& r = *requests->front();
              r.sink = reactor->sink();
              r.speculate_tokens = *speculate;
              // The first message goes out at once: the input token count (and seed, input text).
              reactor->Push(StreamHeader(r));
              batcher_.Enqueue(std::move(*requests));
            });
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::Tokenize(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire_request,
                                                      grpc::ByteBuffer* wire_response) {
  fmaas::BatchedTokenizeRequest request;
  if (absl::Status st = DecodeRequest(*wire_request, &request); !st.ok()) {
    return RefuseUndecodable(context, st);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<fmaas::BatchedTokenizeResponse> response = TokenizeAll(request);
  if (!response.ok()) {
    reactor->Finish(ToGrpcStatus(response.status()));
    return reactor;
  }
  EncodeResponse(*response, wire_response);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::StatusOr<fmaas::BatchedTokenizeResponse> GenerationService::TokenizeAll(
    const fmaas::BatchedTokenizeRequest& request) {
  const Clock::time_point start = Clock::now();
  metrics::TgiMetrics* m = options_.metrics;
  if (m != nullptr) {
    m->tokenize_request_count->Add(1);
    m->tokenize_request_input_count->Add(request.requests_size());
  }
  if (std::optional<std::string> prefix_id = SelectedPrefix(request)) {
    absl::StatusOr<uint32_t> length = PrefixLength(*prefix_id);
    if (!length.ok()) return PromptPrefixError(*prefix_id, length.status());
  }
  fmaas::BatchedTokenizeResponse response;
  uint64_t total_tokens = 0;
  for (const fmaas::TokenizeRequest& r : request.requests()) {
    absl::StatusOr<Encoding> e = EncodeTail(tokenizer_, r.text(), request.truncate_input_tokens());
    if (!e.ok()) return TokenizerError(e.status());
    fmaas::TokenizeResponse* out = response.add_responses();
    out->set_token_count(static_cast<uint32_t>(e->ids.size()));
    total_tokens += e->ids.size();
    if (request.return_tokens()) out->mutable_tokens()->Add(e->tokens.begin(), e->tokens.end());
    if (request.return_offsets()) {
      for (const TokenOffset& o : e->offsets) {
        fmaas::TokenizeResponse::Offset* offset = out->add_offsets();
        offset->set_start(o.start);
        offset->set_end(o.end);
      }
    }
  }
  if (m != nullptr) {
    m->tokenize_request_tokens->Observe(static_cast<double>(total_tokens));
    m->tokenize_request_duration->Observe(Seconds(Clock::now() - start));
  }
  return response;
}

grpc::ServerUnaryReactor* GenerationService::ModelInfo(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* wire_request,
                                                       grpc::ByteBuffer* wire_response) {
  fmaas::ModelInfoRequest request;
  if (absl::Status st = DecodeRequest(*wire_request, &request); !st.ok()) {
    return RefuseUndecodable(context, st);
  }
  fmaas::ModelInfoResponse response;
  response.set_model_kind(options_.model_kind);
  response.set_max_sequence_length(options_.limits.max_sequence_length);
  response.set_max_new_tokens(options_.limits.max_new_tokens);
  EncodeResponse(response, wire_response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace tgis::router

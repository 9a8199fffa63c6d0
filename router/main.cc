// text-generation-router: the public gRPC API (fmaas.GenerationService, health, reflection) in
// front of the model shards.
//
//   text-generation-router --tokenizer-path MODEL_DIR [--shard-uds-path
//   /tmp/text-generation-server]
//       [--num-shard 1] [--grpc-port 8033] [--max-sequence-length N] [--max-new-tokens 1024] ...
//       [--port 3000] [--tls-cert-path CERT --tls-key-path KEY [--tls-client-ca-cert-path CA]]
//
// GET /health and GET /metrics are served on --port; TLS (or mTLS) applies to the gRPC port.
// Every flag also reads the environment variable TGIS gives it (below) when not given.
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/env_flags.h"
#include "metrics/http_server.h"
#include "metrics/registry.h"
#include "metrics/tgi_metrics.h"
#include "router/batcher.h"
#include "router/generation_service.h"
#include "router/health.h"
#include "router/request_progress.h"
#include "router/shard_client.h"
#include "router/tls_config.h"
#include "tokenizer/tokenizer.h"
#include "tracing/tracing.h"

DEFINE_string(tokenizer_path, "",
              "Model directory holding the tokenizer files, or its tokenizer.json "
              "(env TOKENIZER_PATH)");
DEFINE_string(shard_uds_path, "/tmp/text-generation-server",
              "Unix socket prefix of the shards: shard N listens on <path>-N (env SHARD_UDS_PATH)");
DEFINE_int32(num_shard, 1, "Number of shards; every one gets every call (env NUM_SHARD)");
DEFINE_int32(grpc_port, 8033, "Port of the gRPC API (env GRPC_PORT)");
DEFINE_int32(max_sequence_length, 0,
             "Most tokens of input plus output per request; 0: the model's maximum position "
             "(env MAX_SEQUENCE_LENGTH)");
DEFINE_int32(max_new_tokens, 1024,
             "Largest max_new_tokens a request may ask for (env MAX_NEW_TOKENS)");
DEFINE_int32(max_batch_size, 12, "Most requests in the running batch (env MAX_BATCH_SIZE)");
DEFINE_int32(max_concurrent_requests, 512,
             "Most requests queued or running; more are refused with RESOURCE_EXHAUSTED "
             "(env MAX_CONCURRENT_REQUESTS)");
DEFINE_int32(max_waiting_tokens, 24,
             "Decode steps after which a waiting request may always interrupt decoding with its "
             "prefill (env MAX_WAITING_TOKENS)");
DEFINE_double(max_prefill_padding, 0.2,
              "Most padding, as a fraction of a prefill's tokens, that a new batch may carry; our "
              "batches are ragged (never padded), so only a value below 0 refuses anything "
              "(env MAX_PREFILL_PADDING)");
DEFINE_int64(max_batch_weight, 0,
             "Most tokens the running batch may hold in the KV cache; 0: what the shards report "
             "at warmup, which also caps it (env MAX_BATCH_WEIGHT)");
DEFINE_bool(output_special_tokens, false,
            "Keep special tokens (e.g. EOS) in the output text (env OUTPUT_SPECIAL_TOKENS)");
DEFINE_bool(default_include_stop_seqs, true,
            "Whether a matched stop sequence stays in the output when a request does not say "
            "(env DEFAULT_INCLUDE_STOP_SEQS)");
DEFINE_bool(preemption, false,
            "Admit requests by the KV cache they need over the next block of tokens instead of "
            "their whole run (TGIS); when the cache runs out, the shards preempt the newest "
            "running requests and they resume, recomputed, when blocks free up: more requests "
            "run at once, outputs are unchanged (env PREEMPTION)");
DEFINE_int32(prefill_chunk_tokens, 0,
             "Chunked prefill: the most prompt tokens one step computes; the rest of a long "
             "prompt goes on in the next steps beside the running requests' tokens, keeping "
             "their inter-token latency bounded. 0: whole prompts, as TGIS (env "
             "PREFILL_CHUNK_TOKENS)");
DEFINE_int32(speculate, 0,
             "Speculative decoding by prompt lookup: draft tokens (copied from where a "
             "request's last tokens occurred before, in its prompt or output) that one step may "
             "verify; greedy outputs are unchanged, sampled ones keep their distribution "
             "(rejection sampling). 0: off (env SPECULATE)");
DEFINE_int32(shard_connect_timeout, 600,
             "Seconds to wait for the shards to come up (env SHARD_CONNECT_TIMEOUT)");
DEFINE_int32(shard_step_timeout, 600,
             "Seconds one prefill or decode step may take before its batch fails and the "
             "server turns unhealthy (a hung shard); 0: no limit (env SHARD_STEP_TIMEOUT)");
DEFINE_int32(
    shutdown_grace_period, 30,
    "Seconds that running requests get to finish after SIGTERM (env SHUTDOWN_GRACE_PERIOD)");
DEFINE_int32(port, 3000,
             "HTTP port of GET /health and GET /metrics (Prometheus); 0: any free port "
             "(env PORT)");
DEFINE_string(otlp_endpoint, "",
              "OpenTelemetry collector's OTLP/gRPC endpoint (http://host:4317); empty: no "
              "tracing (env OTLP_ENDPOINT)");
DEFINE_string(otlp_service_name, "text-generation-inference.router",
              "service.name of the exported spans (env OTLP_SERVICE_NAME, OTEL_SERVICE_NAME)");
DEFINE_string(tls_cert_path, "",
              "Server certificate (PEM, may hold the chain): with --tls-key-path, enables TLS on "
              "the gRPC port (env TLS_CERT_PATH)");
DEFINE_string(tls_key_path, "",
              "Private key (PEM, unencrypted) of --tls-cert-path (env TLS_KEY_PATH)");
DEFINE_string(tls_client_ca_cert_path, "",
              "CA certificate(s) (PEM) that client certificates must chain to: clients without "
              "such a certificate are refused (mTLS) (env TLS_CLIENT_CA_CERT_PATH)");

namespace {

constexpr int kMaxRequestBytes = 4 << 20;

// Binds 0.0.0.0:port as gRPC will (SO_REUSEADDR) and lets it go again.
absl::Status CheckPortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound =
      bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 && listen(fd, 1) == 0;
  const int err = errno;
  close(fd);
  if (bound) return absl::OkStatus();
  return absl::UnavailableError(strerror(err));
}

using tgis::router::Clock;

int Fail(const std::string& message) {
  LOG(ERROR) << message;
  std::fprintf(stderr, "text-generation-router: %s\n", message.c_str());
  return 1;
}

std::shared_ptr<grpc::ServerCredentials> GrpcCredentials(
    const std::optional<tgis::router::TlsConfig>& tls) {
  if (!tls.has_value()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls->mutual() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = tls->client_ca_pem;
  options.pem_key_cert_pairs.push_back({tls->private_key_pem, tls->cert_chain_pem});
  return grpc::SslServerCredentials(options);
}

// TGIS passes the tokenizer.json file; a model directory works too.
std::string TokenizerDir(const std::string& path) {
  if (std::filesystem::is_regular_file(path)) {
    return std::filesystem::path(path).parent_path().string();
  }
  return path;
}

// The router reads tokenizer.json only, as TGIS's router does (its launcher writes one for
// models that lack it): SentencePiece .model support is not linked in (see
// tokenizer/sentencepiece.h), so say clearly what is missing.
absl::Status CheckTokenizerJson(const std::string& dir) {
  const std::filesystem::path file = std::filesystem::path(dir) / "tokenizer.json";
  if (std::filesystem::is_regular_file(file)) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat(file.string(),
                   ": not found; the router needs the model's tokenizer.json (a SentencePiece "
                   ".model alone is not supported by the router)"));
}

// SIGTERM/SIGINT: blocked in every thread (gRPC's included) and taken by one thread. Before the
// server is up (e.g. while waiting for the shards) they end the process at once; after, they
// are handed to main(), which drains.
class ShutdownSignals {
 public:
  ShutdownSignals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([this, set] {
      int signal = 0;
      sigwait(&set, &signal);
      if (!serving_.load()) {
        LOG(INFO) << "signal " << signal << " before serving: exiting";
        std::_Exit(0);
      }
      received_.set_value(signal);
    }).detach();
  }

  // From now on a signal drains instead of exiting.
  void Serving() { serving_ = true; }
  int Wait() { return received_.get_future().get(); }

 private:
  std::atomic<bool> serving_{false};
  std::promise<int> received_;
};

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("--tokenizer-path MODEL_DIR [--shard-uds-path PATH] [--grpc-port N]");
  tgis::NormalizeDashedFlags(argc, argv);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  if (std::string err = tgis::ApplyEnvFallbacks({
          {"tokenizer_path", "TOKENIZER_PATH"},
          {"shard_uds_path", "SHARD_UDS_PATH"},
          {"num_shard", "NUM_SHARD"},
          {"grpc_port", "GRPC_PORT"},
          {"max_sequence_length", "MAX_SEQUENCE_LENGTH"},
          {"max_new_tokens", "MAX_NEW_TOKENS"},
          {"max_batch_size", "MAX_BATCH_SIZE"},
          {"max_concurrent_requests", "MAX_CONCURRENT_REQUESTS"},
          {"max_waiting_tokens", "MAX_WAITING_TOKENS"},
          {"max_batch_weight", "MAX_BATCH_WEIGHT"},
          {"max_prefill_padding", "MAX_PREFILL_PADDING"},
          {"output_special_tokens", "OUTPUT_SPECIAL_TOKENS"},
          {"default_include_stop_seqs", "DEFAULT_INCLUDE_STOP_SEQS"},
          {"shard_connect_timeout", "SHARD_CONNECT_TIMEOUT"},
          {"preemption", "PREEMPTION"},
          {"prefill_chunk_tokens", "PREFILL_CHUNK_TOKENS"},
          {"speculate", "SPECULATE"},
          {"shard_step_timeout", "SHARD_STEP_TIMEOUT"},
          {"shutdown_grace_period", "SHUTDOWN_GRACE_PERIOD"},
          {"port", "PORT"},
          {"tls_cert_path", "TLS_CERT_PATH"},
          {"tls_key_path", "TLS_KEY_PATH"},
          {"tls_client_ca_cert_path", "TLS_CLIENT_CA_CERT_PATH"},
          {"otlp_endpoint", "OTLP_ENDPOINT"},
          {"otlp_service_name", "OTLP_SERVICE_NAME"},
      });
      !err.empty()) {
    return Fail(err);
  }
  if (argc != 1) return Fail(absl::StrCat("unexpected argument '", argv[1], "'"));
  // TGIS's router reads OTEL_SERVICE_NAME too.
  if (const char* otel = std::getenv("OTEL_SERVICE_NAME");
      otel != nullptr && *otel != '\0' &&
      gflags::GetCommandLineFlagInfoOrDie("otlp_service_name").is_default &&
      std::getenv("OTLP_SERVICE_NAME") == nullptr) {
    FLAGS_otlp_service_name = otel;
  }
  auto tracing =
      tgis::tracing::TracingSession::FromFlags(FLAGS_otlp_endpoint, FLAGS_otlp_service_name);
  if (!tracing.ok()) return Fail(std::string(tracing.status().message()));
  if (FLAGS_tokenizer_path.empty()) return Fail("--tokenizer-path (TOKENIZER_PATH) is required");
  for (auto [value, minimum, name] :
       {std::tuple{int64_t{FLAGS_max_new_tokens}, 1, "--max-new-tokens (MAX_NEW_TOKENS)"},
        std::tuple{int64_t{FLAGS_max_batch_size}, 1, "--max-batch-size (MAX_BATCH_SIZE)"},
        std::tuple{int64_t{FLAGS_max_concurrent_requests}, 1,
                   "--max-concurrent-requests (MAX_CONCURRENT_REQUESTS)"},
        std::tuple{int64_t{FLAGS_max_waiting_tokens}, 1,
                   "--max-waiting-tokens (MAX_WAITING_TOKENS)"},
        std::tuple{int64_t{FLAGS_max_sequence_length}, 0,
                   "--max-sequence-length (MAX_SEQUENCE_LENGTH)"},
        std::tuple{int64_t{FLAGS_max_batch_weight}, 0, "--max-batch-weight (MAX_BATCH_WEIGHT)"},
        std::tuple{int64_t{FLAGS_shard_step_timeout}, 0,
                   "--shard-step-timeout (SHARD_STEP_TIMEOUT)"}}) {
    if (value < minimum) {
      return Fail(absl::StrCat(name, " is ", value, "; it must be ",
                               minimum == 1 ? "positive" : "zero (unset) or positive"));
    }
  }
  if (FLAGS_port < 0 || FLAGS_port > 65535) return Fail("--port (PORT) must be a TCP port");
  // TLS files are checked before anything waits: a bad one fails the start, naming the file.
  auto tls = tgis::router::LoadTlsConfig(
      {FLAGS_tls_cert_path, FLAGS_tls_key_path, FLAGS_tls_client_ca_cert_path});
  if (!tls.ok()) return Fail(absl::StrCat("invalid TLS configuration: ", tls.status().message()));
  // The gRPC port is bound last (after the shards are up): a port in use must fail now.
  if (absl::Status s = CheckPortFree(FLAGS_grpc_port); !s.ok()) {
    return Fail(absl::StrCat("--grpc-port (GRPC_PORT) ", FLAGS_grpc_port, ": ", s.message()));
  }
  ShutdownSignals signals;

  // The tokenizer first: a wrong model directory fails before anything waits on the shards.
  const std::string tokenizer_dir = TokenizerDir(FLAGS_tokenizer_path);
  if (absl::Status s = CheckTokenizerJson(tokenizer_dir); !s.ok()) {
    return Fail(absl::StrCat("cannot load the tokenizer: ", s.message()));
  }
  auto tokenizer = tgis::Tokenizer::FromDirectory(tokenizer_dir);
  if (!tokenizer.ok()) {
    return Fail(absl::StrCat("cannot load the tokenizer: ", tokenizer.status().message()));
  }

  // /health and /metrics answer while the router waits for the shards (503 until they are
  // ready and a generation has succeeded).
  tgis::metrics::Registry registry;
  tgis::metrics::TgiMetrics tgi_metrics(
      &registry,
      {.max_sequence_length =
           FLAGS_max_sequence_length > 0 ? static_cast<uint32_t>(FLAGS_max_sequence_length) : 2048u,
       .max_new_tokens = static_cast<uint32_t>(FLAGS_max_new_tokens),
       .max_batch_size = static_cast<uint32_t>(FLAGS_max_batch_size)});
  tgis::router::HealthMonitor health_monitor;
  tgis::metrics::HttpServer http([&health_monitor] { return health_monitor.Check(); },
                                 [&registry] { return registry.Render(); });
  if (!http.Start(FLAGS_port)) {
    return Fail(absl::StrCat("cannot listen on HTTP port ", FLAGS_port,
                             " (--port / PORT, for /health and /metrics): ", http.error()));
  }
  LOG(INFO) << "HTTP server listening on port " << http.port() << " (/health, /metrics)";

  auto shards = tgis::router::ConnectShards(FLAGS_shard_uds_path, FLAGS_num_shard,
                                            std::chrono::seconds(FLAGS_shard_connect_timeout),
                                            std::chrono::seconds(FLAGS_shard_step_timeout));
  if (!shards.ok()) return Fail(std::string(shards.status().message()));
  // A restarted router must not inherit batches from its previous life.
  if (absl::Status s = (*shards)->ClearCache(std::nullopt); !s.ok()) {
    return Fail(absl::StrCat("ClearCache failed: ", s.message()));
  }
  auto info = (*shards)->Info();
  if (!info.ok()) return Fail(absl::StrCat("Info failed: ", info.status().message()));

  uint32_t max_sequence_length = info->max_position_embeddings();
  if (max_sequence_length == 0) {
    // A model without a position limit (ALiBi, as BLOOM): MAX_SEQUENCE_LENGTH or TGIS's 2048.
    max_sequence_length =
        FLAGS_max_sequence_length > 0 ? static_cast<uint32_t>(FLAGS_max_sequence_length) : 2048u;
  } else if (FLAGS_max_sequence_length > 0) {
    if (static_cast<uint32_t>(FLAGS_max_sequence_length) > max_sequence_length) {
      LOG(WARNING) << "--max-sequence-length " << FLAGS_max_sequence_length
                   << " exceeds the model's " << max_sequence_length << " positions; using "
                   << max_sequence_length;
    } else {
      max_sequence_length = static_cast<uint32_t>(FLAGS_max_sequence_length);
    }
  }
  generate::v1::WarmupRequest warmup_request;
  warmup_request.set_max_input_length(max_sequence_length);
  warmup_request.set_max_batch_size(static_cast<uint32_t>(FLAGS_max_batch_size));
  warmup_request.set_max_batch_total_tokens(static_cast<uint32_t>(FLAGS_max_batch_weight));
  // Guided decoding's automata are matched by the tokens' bytes in the shards.
  const uint32_t vocab = info->vocab_size() > 0 ? info->vocab_size()
                                                : static_cast<uint32_t>((*tokenizer)->VocabSize());
  for (uint32_t id = 0; id < vocab; ++id) {
    warmup_request.add_token_bytes(
        (*tokenizer)->TokenBytes(static_cast<int32_t>(id)).value_or(std::string()));
  }
  auto warmup = (*shards)->Warmup(warmup_request);
  if (!warmup.ok()) return Fail(absl::StrCat("Warmup failed: ", warmup.status().message()));
  uint64_t batch_tokens = warmup->max_supported_total_tokens();
  if (FLAGS_max_batch_weight > 0) {
    batch_tokens = std::min<uint64_t>(batch_tokens, static_cast<uint64_t>(FLAGS_max_batch_weight));
  }
  if (batch_tokens < max_sequence_length) {
    // One request of the maximum length must always fit in the KV cache.
    LOG(WARNING) << "the KV cache holds " << batch_tokens << " tokens: max sequence length "
                 << max_sequence_length << " lowered to it";
    max_sequence_length = static_cast<uint32_t>(batch_tokens);
  }
  if (max_sequence_length < 2) return Fail("the KV cache is too small for any request");
  // As TGIS: a request can never generate more than max_sequence_length - 1 tokens (one input
  // token at least), and ModelInfo and validation both say so.
  uint32_t max_new_tokens = static_cast<uint32_t>(FLAGS_max_new_tokens);
  if (max_new_tokens >= max_sequence_length) {
    LOG(INFO) << "adjusting max_new_tokens (" << max_new_tokens
              << ") down to max_sequence_length - 1 (" << max_sequence_length - 1 << ")";
    max_new_tokens = max_sequence_length - 1;
  }

  tgi_metrics.Reshape({.max_sequence_length = max_sequence_length,
                       .max_new_tokens = max_new_tokens,
                       .max_batch_size = static_cast<uint32_t>(FLAGS_max_batch_size)});

  tgis::router::BatcherConfig batcher_config;
  batcher_config.admission.max_batch_size = static_cast<uint32_t>(FLAGS_max_batch_size);
  batcher_config.admission.max_batch_tokens = batch_tokens;
  batcher_config.admission.block_size = std::max<uint32_t>(warmup->block_size(), 1);
  // The shards' prefill weight limit; one request of the longest length must always fit.
  if (warmup->max_prefill_tokens() > 0) {
    batcher_config.admission.max_prefill_tokens =
        std::max<uint64_t>(warmup->max_prefill_tokens(), max_sequence_length);
  }
  batcher_config.admission.max_prefill_padding = FLAGS_max_prefill_padding;
  if (FLAGS_preemption) {
    if (info->can_preempt()) {
      batcher_config.admission.lookahead_steps = batcher_config.admission.block_size;
    } else {
      LOG(WARNING) << "--preemption: " << info->model_type()
                   << " with length-dependent rotary frequencies cannot be preempted exactly; "
                      "requests are admitted for their whole run";
    }
  }
  batcher_config.max_waiting_tokens = static_cast<uint32_t>(FLAGS_max_waiting_tokens);
  if (FLAGS_prefill_chunk_tokens < 0) {
    return Fail(
        absl::StrCat("--prefill-chunk-tokens must be >= 0, not ", FLAGS_prefill_chunk_tokens));
  }
  batcher_config.prefill_chunk_tokens = static_cast<uint32_t>(FLAGS_prefill_chunk_tokens);
  if (FLAGS_speculate < 0 || FLAGS_speculate > 64) {
    return Fail(absl::StrCat("--speculate must be in [0, 64], not ", FLAGS_speculate));
  }
  batcher_config.speculate_tokens = static_cast<uint32_t>(FLAGS_speculate);
  batcher_config.detokenization.skip_special_tokens = !FLAGS_output_special_tokens;
  for (uint32_t id : info->eos_token_ids()) {
    batcher_config.detokenization.eos_token_ids.push_back(static_cast<int32_t>(id));
  }
  if (batcher_config.detokenization.eos_token_ids.empty() &&
      (*tokenizer)->special_ids().eos.has_value()) {
    batcher_config.detokenization.eos_token_ids.push_back(*(*tokenizer)->special_ids().eos);
  }
  const bool seq2seq = info->model_kind() == generate::v1::ENCODER_DECODER;
  batcher_config.detokenization.seq2seq = seq2seq;
  // An encoder-decoder model's output starts a text of its own: decoded whole, as TGIS does.
  if (!seq2seq) {
    batcher_config.detokenization.placeholder_id =
        tgis::router::ContinuationPlaceholder(**tokenizer);
  }
  // grpc.health.v1 reports NOT_SERVING while the shards fail (the server is built below).
  std::atomic<grpc::HealthCheckServiceInterface*> health{nullptr};
  batcher_config.on_shard_health = [&health](bool serving) {
    if (auto* h = health.load()) h->SetServingStatus(serving);
  };
  batcher_config.on_generation_result = [&health_monitor](bool ok) {
    health_monitor.OnGenerationResult(ok);
  };
  batcher_config.metrics = &tgi_metrics;
  tgis::router::Batcher batcher(**shards, **tokenizer, batcher_config);
  batcher.Start();
  tgis::router::ShardClient& shard_client = **shards;

  tgis::router::ServiceOptions service_options;
  service_options.limits.max_sequence_length = max_sequence_length;
  service_options.limits.max_new_tokens = max_new_tokens;
  service_options.limits.default_include_stop_seqs = FLAGS_default_include_stop_seqs;
  service_options.max_concurrent_requests = static_cast<uint32_t>(FLAGS_max_concurrent_requests);
  service_options.metrics = &tgi_metrics;
  service_options.prefix_lookup = [&shard_client](const std::string& id) {
    return shard_client.PrefixLookup(id);
  };
  service_options.model_kind =
      seq2seq ? fmaas::ModelInfoResponse::ENCODER_DECODER : fmaas::ModelInfoResponse::DECODER_ONLY;
  tgis::router::GenerationService service(**tokenizer, batcher, service_options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat("0.0.0.0:", FLAGS_grpc_port);
  builder.AddListeningPort(address, GrpcCredentials(*tls));
  // Without this a second server could bind the same port (SO_REUSEPORT) and share its calls.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // TGIS's router (tonic) decodes messages of up to 4 MiB; a larger one is refused before it is
  // read into memory (RESOURCE_EXHAUSTED), as there.
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return Fail(absl::StrCat("cannot listen on ", address));
  health = server->GetHealthCheckService();
  // /health answers 200 only from here on: a readiness probe that passed before the gRPC port
  // listened would send clients to a closed port.
  health_monitor.Attach(
      [&shard_client] { return shard_client.Health().ok(); },
      [&batcher](std::function<void(bool)> done) { batcher.EnqueueHealthCheck(std::move(done)); });
  // Probes stop using the shards and the batcher before those go, whatever way main() ends.
  struct DetachHealth {
    tgis::router::HealthMonitor& monitor;
    ~DetachHealth() { monitor.Detach(); }
  } detach_health{health_monitor};
  LOG(INFO) << "gRPC server listening on " << address
            << (tls->has_value() ? ((*tls)->mutual() ? " with mTLS" : " with TLS") : "") << " ("
            << info->model_type() << ", max sequence length " << max_sequence_length
            << ", KV cache " << batch_tokens << " tokens, " << FLAGS_num_shard << " shard(s))";

  signals.Serving();
  const int signal = signals.Wait();
  LOG(INFO) << "signal " << signal << ": draining for up to " << FLAGS_shutdown_grace_period << "s";
  health = nullptr;
  health_monitor.Detach();
  server->GetHealthCheckService()->SetServingStatus(false);
  // gRPC cancels the calls still open at its deadline, which the batcher would take for
  // clients going away: at the end of the grace period the batcher ends what is left first
  // (UNAVAILABLE "the server is shutting down", logged as such), and gRPC's deadline comes
  // just after.
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(FLAGS_shutdown_grace_period);
  std::atomic<bool> drained{false};
  std::thread grpc_shutdown([&] {
    server->Shutdown(deadline + std::chrono::milliseconds(500));
    drained = true;
  });
  while (!drained && std::chrono::system_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  batcher.Stop();
  grpc_shutdown.join();
  http.Stop();
  LOG(INFO) << "stopped";
  return 0;
}

// text-generation-launcher: resolves the model, starts NUM_SHARD shards and waits for them,
// then starts the router; forwards SIGTERM (the router drains in-flight requests within the
// grace period) and takes everything down, exiting non-zero, when any child dies.
#include <gflags/gflags.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "common/env_flags.h"
#include "launcher/child_process.h"
#include "launcher/log_sink.h"
#include "launcher/model_resolver.h"

DEFINE_string(model_name, "", "Model directory, or hub id in the local HF cache (env MODEL_NAME)");
DEFINE_string(revision, "", "Model revision in the HF cache: commit, branch or tag (env REVISION)");
DEFINE_int32(num_shard, 1, "Number of model shards (env NUM_SHARD)");
DEFINE_string(dtype_str, "",
              "Weight dtype: float32, bfloat16, float16; default float32 on the CPU, bfloat16 "
              "on GPUs (env DTYPE_STR)");
DEFINE_int32(
    max_sequence_length, 0,
    "Longest input + output in tokens; 0: the model's max positions (env MAX_SEQUENCE_LENGTH)");
DEFINE_int32(max_new_tokens, 1024,
             "Largest max_new_tokens a request may ask for (env MAX_NEW_TOKENS)");
DEFINE_int32(max_batch_size, 12, "Most requests decoded together (env MAX_BATCH_SIZE)");
DEFINE_int32(
    max_concurrent_requests, 96,
    "Requests in the server at once before RESOURCE_EXHAUSTED (env MAX_CONCURRENT_REQUESTS)");
DEFINE_int32(
    max_waiting_tokens, 24,
    "Decode steps queued requests may wait before a prefill joins them (env MAX_WAITING_TOKENS)");
DEFINE_int64(max_batch_weight, 0,
             "Most tokens in the KV cache; 0: what Warmup measures (env MAX_BATCH_WEIGHT)");
DEFINE_int32(port, 3000, "HTTP port of /health and /metrics (env PORT)");
DEFINE_int32(grpc_port, 8033, "Port of the gRPC API (env GRPC_PORT)");
DEFINE_string(shard_uds_path, "/tmp/text-generation-server",
              "Unix socket prefix of the shards (env SHARD_UDS_PATH)");
DEFINE_string(master_addr, "localhost", "Rendezvous address of the shards (env MASTER_ADDR)");
DEFINE_int32(master_port, 29500, "Rendezvous port of the shards (env MASTER_PORT)");
DEFINE_string(tls_cert_path, "",
              "Server certificate (PEM) enabling TLS on gRPC (env TLS_CERT_PATH)");
DEFINE_string(tls_key_path, "", "Private key (PEM) of the certificate (env TLS_KEY_PATH)");
DEFINE_string(
    tls_client_ca_cert_path, "",
    "CA (PEM) that client certificates must chain to: mTLS (env TLS_CLIENT_CA_CERT_PATH)");
DEFINE_bool(output_special_tokens, false,
            "Keep special tokens in output text (env OUTPUT_SPECIAL_TOKENS)");
DEFINE_bool(default_include_stop_seqs, true,
            "Default of include_stop_sequence (env DEFAULT_INCLUDE_STOP_SEQS)");
DEFINE_bool(json_output, false, "Log as JSON lines (env JSON_OUTPUT)");
DEFINE_int32(shutdown_grace_period, 30,
             "Seconds in-flight requests get to finish after SIGTERM (env SHUTDOWN_GRACE_PERIOD)");
DEFINE_int32(shard_startup_timeout, 600,
             "Seconds to wait for a shard to listen (env SHARD_STARTUP_TIMEOUT)");
DEFINE_string(termination_log, "/dev/termination-log",
              "Where a fatal exit's reason is written, when writable (env TERMINATION_LOG)");
DEFINE_string(bin_dir, "",
              "Where text-generation-server and -router are; default: beside the launcher");

namespace {

namespace fs = std::filesystem;
using tgis::launcher::ChildProcess;
using tgis::launcher::LogSink;

volatile sig_atomic_t g_stop_signal = 0;
void OnStopSignal(int sig) { g_stop_signal = sig; }

void WriteTerminationLog(const std::string& reason) {
  std::ofstream out(FLAGS_termination_log, std::ios::trunc);
  if (out) out << reason << "\n";
}

std::string BinDir(const char* argv0) {
  if (!FLAGS_bin_dir.empty()) return FLAGS_bin_dir;
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) self = fs::absolute(argv0);
  return self.parent_path().string();
}

// Finds an executable named `name` in the build layout (router/, server/) or beside us.
std::string FindBinary(const std::string& dir, const std::string& name, const std::string& sub) {
  for (const fs::path& p : {fs::path(dir) / name, fs::path(dir) / ".." / sub / name}) {
    std::error_code ec;
    if (fs::exists(p, ec)) return fs::weakly_canonical(p, ec).string();
  }
  return (fs::path(dir) / name).string();
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "--model-name MODEL [--num-shard N] ... (every flag has an env fallback)");
  tgis::NormalizeDashedFlags(argc, argv);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  const std::string env_error =
      tgis::ApplyEnvFallbacks({{"model_name", "MODEL_NAME"},
                               {"revision", "REVISION"},
                               {"num_shard", "NUM_SHARD"},
                               {"dtype_str", "DTYPE_STR"},
                               {"max_sequence_length", "MAX_SEQUENCE_LENGTH"},
                               {"max_new_tokens", "MAX_NEW_TOKENS"},
                               {"max_batch_size", "MAX_BATCH_SIZE"},
                               {"max_concurrent_requests", "MAX_CONCURRENT_REQUESTS"},
                               {"max_waiting_tokens", "MAX_WAITING_TOKENS"},
                               {"max_batch_weight", "MAX_BATCH_WEIGHT"},
                               {"port", "PORT"},
                               {"grpc_port", "GRPC_PORT"},
                               {"shard_uds_path", "SHARD_UDS_PATH"},
                               {"master_addr", "MASTER_ADDR"},
                               {"master_port", "MASTER_PORT"},
                               {"tls_cert_path", "TLS_CERT_PATH"},
                               {"tls_key_path", "TLS_KEY_PATH"},
                               {"tls_client_ca_cert_path", "TLS_CLIENT_CA_CERT_PATH"},
                               {"output_special_tokens", "OUTPUT_SPECIAL_TOKENS"},
                               {"default_include_stop_seqs", "DEFAULT_INCLUDE_STOP_SEQS"},
                               {"json_output", "JSON_OUTPUT"},
                               {"shutdown_grace_period", "SHUTDOWN_GRACE_PERIOD"},
                               {"shard_startup_timeout", "SHARD_STARTUP_TIMEOUT"},
                               {"termination_log", "TERMINATION_LOG"}});
  LogSink log(FLAGS_json_output);
  auto fatal = [&log](const std::string& reason) {
    log.Error(reason);
    WriteTerminationLog(reason);
    return 1;
  };
  if (!env_error.empty()) return fatal(env_error);
  if (argc != 1) return fatal(std::string("unexpected argument '") + argv[1] + "'");
  if (FLAGS_num_shard < 1) return fatal("--num-shard must be at least 1");

  auto model = tgis::launcher::ResolveModel(FLAGS_model_name, FLAGS_revision,
                                            tgis::launcher::CacheDirs::FromEnvironment());
  if (!model.ok()) return fatal(std::string(model.status().message()));
  log.Info("model " + FLAGS_model_name + " -> " + *model);

  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  const std::string bin = BinDir(argv[0]);
  const std::string server_bin = FindBinary(bin, "text-generation-server", "server");
  const std::string router_bin = FindBinary(bin, "text-generation-router", "router");
  // A child that fails says why in its last "text-generation-<name>: <reason>" line (e.g. the
  // router naming a bad TLS file): the termination log gets that reason too.
  std::mutex fatal_lines_mu;
  std::map<std::string, std::string> fatal_lines;
  auto sink = [&log, &fatal_lines_mu, &fatal_lines](const std::string& name,
                                                    const std::string& line) {
    log.Child(name, line);
    for (const char* prefix : {"text-generation-router: ", "text-generation-server: "}) {
      if (line.rfind(prefix, 0) == 0) {
        std::lock_guard<std::mutex> lock(fatal_lines_mu);
        fatal_lines[name] = line.substr(std::strlen(prefix));
      }
    }
  };
  auto why = [&fatal_lines_mu, &fatal_lines](ChildProcess& child) {
    child.DrainOutput();
    std::lock_guard<std::mutex> lock(fatal_lines_mu);
    auto it = fatal_lines.find(child.name());
    return it == fatal_lines.end() ? std::string() : ": " + it->second;
  };

  std::vector<std::unique_ptr<ChildProcess>> shards;
  for (int rank = 0; rank < FLAGS_num_shard; ++rank) {
    auto child = std::make_unique<ChildProcess>();
    std::string error;
    std::error_code ec;
    fs::remove(FLAGS_shard_uds_path + "-" + std::to_string(rank), ec);
    const std::map<std::string, std::string> env = {
        {"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(FLAGS_num_shard)},
        {"MASTER_ADDR", FLAGS_master_addr},
        {"MASTER_PORT", std::to_string(FLAGS_master_port)}};
    std::vector<std::string> args = {server_bin,
                                     "serve",
                                     *model,
                                     "--uds-path",
                                     FLAGS_shard_uds_path,
                                     "--rank",
                                     std::to_string(rank),
                                     "--world-size",
                                     std::to_string(FLAGS_num_shard)};
    if (!FLAGS_dtype_str.empty()) {  // else the shard picks by device
      args.insert(args.end(), {"--dtype", FLAGS_dtype_str});
    }
    if (!child->Start("shard-" + std::to_string(rank), args, env, sink, &error)) {
      return fatal("cannot start shard " + std::to_string(rank) + ": " + error);
    }
    shards.push_back(std::move(child));
  }
  auto stop_all = [&](std::vector<std::unique_ptr<ChildProcess>>& procs, double grace) {
    for (auto& p : procs) p->Signal(SIGTERM);
    int status;
    for (auto& p : procs) {
      if (!p->WaitFor(grace, &status)) {
        p->Signal(SIGKILL);
        p->WaitFor(5, &status);
      }
    }
  };
  // Wait for every shard's socket.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(FLAGS_shard_startup_timeout);
  for (int rank = 0; rank < FLAGS_num_shard; ++rank) {
    const std::string socket = FLAGS_shard_uds_path + "-" + std::to_string(rank);
    for (;;) {
      std::error_code ec;
      if (fs::exists(socket, ec)) break;
      int status;
      if (shards[rank]->Exited(&status)) {
        stop_all(shards, 5);
        return fatal("shard " + std::to_string(rank) + " failed to start: " +
                     tgis::launcher::DescribeStatus(status) + why(*shards[rank]));
      }
      if (g_stop_signal != 0) {
        stop_all(shards, 5);
        return 0;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        stop_all(shards, 5);
        return fatal("shard " + std::to_string(rank) + " did not listen on " + socket + " within " +
                     std::to_string(FLAGS_shard_startup_timeout) + "s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    log.Info("shard " + std::to_string(rank) + " ready");
  }

  std::vector<std::string> router_args = {
      router_bin,
      "--tokenizer-path",
      *model,
      "--shard-uds-path",
      FLAGS_shard_uds_path,
      "--num-shard",
      std::to_string(FLAGS_num_shard),
      "--grpc-port",
      std::to_string(FLAGS_grpc_port),
      "--max-sequence-length",
      std::to_string(FLAGS_max_sequence_length),
      "--max-new-tokens",
      std::to_string(FLAGS_max_new_tokens),
      "--max-batch-size",
      std::to_string(FLAGS_max_batch_size),
      "--max-concurrent-requests",
      std::to_string(FLAGS_max_concurrent_requests),
      "--max-waiting-tokens",
      std::to_string(FLAGS_max_waiting_tokens),
      "--max-batch-weight",
      std::to_string(FLAGS_max_batch_weight),
      std::string("--output-special-tokens=") + (FLAGS_output_special_tokens ? "true" : "false"),
      std::string("--default-include-stop-seqs=") +
          (FLAGS_default_include_stop_seqs ? "true" : "false"),
      "--shutdown-grace-period",
      std::to_string(FLAGS_shutdown_grace_period)};
  // HTTP and TLS settings reach the router through its environment.
  std::map<std::string, std::string> router_env = {{"PORT", std::to_string(FLAGS_port)}};
  if (!FLAGS_tls_cert_path.empty()) router_env["TLS_CERT_PATH"] = FLAGS_tls_cert_path;
  if (!FLAGS_tls_key_path.empty()) router_env["TLS_KEY_PATH"] = FLAGS_tls_key_path;
  if (!FLAGS_tls_client_ca_cert_path.empty()) {
    router_env["TLS_CLIENT_CA_CERT_PATH"] = FLAGS_tls_client_ca_cert_path;
  }
  std::vector<std::unique_ptr<ChildProcess>> routers;
  {
    auto router = std::make_unique<ChildProcess>();
    std::string error;
    if (!router->Start("router", router_args, router_env, sink, &error)) {
      stop_all(shards, 5);
      return fatal("cannot start the router: " + error);
    }
    routers.push_back(std::move(router));
  }
  log.Info("router started on gRPC port " + std::to_string(FLAGS_grpc_port));

  // Supervise: a stop signal drains; any child's death takes everything down.
  for (;;) {
    if (g_stop_signal != 0) {
      log.Info("received " + std::string(strsignal(g_stop_signal)) + ", draining for up to " +
               std::to_string(FLAGS_shutdown_grace_period) + "s");
      stop_all(routers, FLAGS_shutdown_grace_period + 5);
      stop_all(shards, 10);
      log.Info("stopped");
      return 0;
    }
    int status;
    for (auto* group : {&routers, &shards}) {
      for (auto& p : *group) {
        if (p->Exited(&status)) {
          const std::string reason =
              p->name() + " " + tgis::launcher::DescribeStatus(status) + why(*p);
          stop_all(routers, 5);
          stop_all(shards, 5);
          return fatal(reason + "; shutting down");
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

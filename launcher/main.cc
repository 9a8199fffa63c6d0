// text-generation-launcher: resolves the model (downloading it with `text-generation-server
// download-weights` when it is not in the cache and HF_HUB_OFFLINE is off, and converting a
// .bin-only checkpoint with convert-to-safetensors, as TGIS does), starts NUM_SHARD shards and
// waits for them, then starts the router; forwards SIGTERM (the router drains in-flight requests
// within the grace period) and takes everything down, exiting non-zero, when any child dies. The
// command line is TGIS's launcher's (launcher_flags.h).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "hub/hub_cache.h"
#include "launcher/child_process.h"
#include "launcher/launcher_flags.h"
#include "launcher/log_sink.h"

namespace {

namespace fs = std::filesystem;
using tgis::launcher::ChildProcess;
using tgis::launcher::LogSink;

volatile sig_atomic_t g_stop_signal = 0;
void OnStopSignal(int sig) { g_stop_signal = sig; }

void WriteTerminationLog(const std::string& path, const std::string& reason) {
  std::ofstream out(path, std::ios::trunc);
  if (out) out << reason << "\n";
}

std::string BinDir(const std::optional<std::string>& bin_dir, const char* argv0) {
  if (bin_dir && !bin_dir->empty()) return *bin_dir;
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
  using tgis::launcher::ParsedCommandLine;
  const tgis::launcher::EnvLookup env = tgis::launcher::ProcessEnv();
  auto parsed =
      tgis::launcher::ParseLauncherFlags(std::vector<std::string>(argv + 1, argv + argc), env);
  if (!parsed.ok()) {
    // A usage error, as clap reports one: on stderr, exit code 2. The termination log gets it
    // too (from TERMINATION_LOG or its default, as the flags did not parse).
    const std::string reason(parsed.status().message());
    std::fprintf(stderr, "text-generation-launcher: error: %s\n", reason.c_str());
    WriteTerminationLog(env("TERMINATION_LOG").value_or("/dev/termination-log"), reason);
    return 2;
  }
  if (parsed->action == ParsedCommandLine::Action::kHelp) {
    std::fputs(tgis::launcher::LauncherHelp().c_str(), stdout);
    return 0;
  }
  if (parsed->action == ParsedCommandLine::Action::kVersion) {
    std::fputs(tgis::launcher::LauncherVersion().c_str(), stdout);
    return 0;
  }
  const tgis::launcher::LauncherFlags& flags = parsed->flags;

  LogSink log(flags.json_output);
  auto fatal = [&log, &flags](const std::string& reason) {
    log.Error(reason);
    WriteTerminationLog(flags.termination_log, reason);
    return 1;
  };
  log.Info("Launcher args: " + tgis::launcher::DescribeFlags(flags));
  auto settings = tgis::launcher::CheckLauncherFlags(flags, env);
  if (!settings.ok()) return fatal(std::string(settings.status().message()));
  for (const std::string& line : settings->info) log.Info(line);
  for (const std::string& line : settings->warnings) log.Warn(line);
  // As TGIS: MAX_PREFILL_WEIGHT is read by nothing.
  if (auto v = env("MAX_PREFILL_WEIGHT"); v && v->find_first_not_of(" \t") != std::string::npos) {
    log.Warn("MAX_PREFILL_WEIGHT is set to " + *v + " but this parameter will be ignored.");
  }
  const int num_shard = settings->num_shard;

  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  const std::string bin = BinDir(flags.bin_dir, argv[0]);
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

  auto cache = tgis::hub::CacheDir::FromProcessEnvironment();
  if (!cache.ok()) return fatal(std::string(cache.status().message()));
  if (!cache->warning.empty()) log.Warn(cache->warning);
  // A tool command (download-weights, convert-to-safetensors) run to its end; "" or why not.
  auto run_tool = [&](const std::string& name, const std::vector<std::string>& args) {
    ChildProcess child;
    std::string error;
    std::map<std::string, std::string> tool_env;
    if (!cache->path.empty()) tool_env["HF_HUB_CACHE"] = cache->path;
    if (!child.Start(name, args, tool_env, sink, &error)) return "cannot start: " + error;
    int status = 0;
    while (!child.WaitFor(0.2, &status)) {
      if (g_stop_signal != 0) {
        child.Signal(SIGTERM);
        if (!child.WaitFor(10, &status)) child.Signal(SIGKILL);
        return std::string("stopped by a signal");
      }
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return std::string();
    return tgis::launcher::DescribeStatus(status) + why(child);
  };
  const std::string revision = flags.revision.value_or("");
  auto model = tgis::hub::ResolveModel(flags.model_name, revision, cache->path);
  if (absl::IsNotFound(model.status()) && !tgis::hub::IsLocalPath(flags.model_name)) {
    if (tgis::hub::OfflineFromEnvironment()) {
      return fatal(std::string(model.status().message()) +
                   " (HF_HUB_OFFLINE is set, so it is not downloaded)");
    }
    log.Info("model " + flags.model_name + " is not in the cache " + cache->path +
             ": downloading it");
    std::vector<std::string> args = {server_bin, "download-weights", flags.model_name,
                                     "--extension", ".safetensors"};
    if (!revision.empty()) args.insert(args.end(), {"--revision", revision});
    if (std::string err = run_tool("download-weights", args); !err.empty()) {
      return fatal("download-weights " + flags.model_name + " failed: " + err);
    }
    model = tgis::hub::ResolveModel(flags.model_name, revision, cache->path);
  }
  if (!model.ok()) return fatal(std::string(model.status().message()));
  log.Info("model " + flags.model_name + " -> " + *model);
  // As TGIS: PyTorch weights only -> safetensors beside them, before any shard starts.
  if (!tgis::hub::HasFileEndingWith(*model, ".safetensors") &&
      tgis::hub::HasFileEndingWith(*model, ".bin")) {
    log.Info(*model + " holds only PyTorch .bin weights: converting them to safetensors");
    if (std::string err =
            run_tool("convert-to-safetensors", {server_bin, "convert-to-safetensors", *model});
        !err.empty()) {
      return fatal("convert-to-safetensors " + *model + " failed: " + err);
    }
  }

  std::vector<std::string> otlp_args;  // for the router and the shards
  if (flags.otlp_endpoint) {
    otlp_args = {"--otlp-endpoint", *flags.otlp_endpoint};
    if (flags.otlp_service_name) {
      otlp_args.insert(otlp_args.end(), {"--otlp-service-name", *flags.otlp_service_name});
    }
  }
  std::vector<std::unique_ptr<ChildProcess>> shards;
  for (int rank = 0; rank < num_shard; ++rank) {
    auto child = std::make_unique<ChildProcess>();
    std::string error;
    std::error_code ec;
    fs::remove(flags.shard_uds_path + "-" + std::to_string(rank), ec);
    const std::map<std::string, std::string> shard_env = {
        {"RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(num_shard)},
        {"MASTER_ADDR", flags.master_addr},
        {"MASTER_PORT", std::to_string(flags.master_port)}};
    std::vector<std::string> args = {
        server_bin, "serve", *model, "--uds-path", flags.shard_uds_path, "--rank",
        std::to_string(rank), "--world-size", std::to_string(num_shard),
        "--cuda_process_memory_fraction=" +
            tgis::launcher::FormatNumber(flags.cuda_process_memory_fraction),
        // As TGIS: the shards size the KV cache, so the margin is theirs.
        "--batch_safety_margin=" + std::to_string(flags.batch_safety_margin)};
    if (!settings->dtype.empty()) {  // else the shard picks by device
      args.insert(args.end(), {"--dtype", settings->dtype});
    }
    if (!settings->quantize.empty()) args.insert(args.end(), {"--quantize", settings->quantize});
    // Tracing: the shards' spans go to the router's collector (their own service name unless
    // one was given).
    args.insert(args.end(), otlp_args.begin(), otlp_args.end());
    if (!child->Start("shard-" + std::to_string(rank), args, shard_env, sink, &error)) {
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
  // The router starts beside the shards, not after them: its own inputs (tokenizer, TLS files,
  // ports) are checked at once, so a mistake there fails the start in seconds, not after every
  // shard has loaded its weights. It waits for the shards itself (a little longer than we do).
  std::vector<std::string> router_args = {
      router_bin,
      "--tokenizer-path",
      *model,
      "--shard-uds-path",
      flags.shard_uds_path,
      "--num-shard",
      std::to_string(num_shard),
      "--grpc-port",
      std::to_string(flags.grpc_port),
      "--max-sequence-length",
      std::to_string(flags.max_sequence_length.value_or(0)),  // 0: the model's positions
      "--max-new-tokens",
      std::to_string(flags.max_new_tokens),
      "--max-batch-size",
      std::to_string(flags.max_batch_size),
      "--max-concurrent-requests",
      std::to_string(flags.max_concurrent_requests),
      "--max-waiting-tokens",
      std::to_string(flags.max_waiting_tokens),
      "--max_prefill_padding=" + tgis::launcher::FormatNumber(flags.max_prefill_padding),
      "--max-batch-weight",
      std::to_string(flags.max_batch_weight),
      std::string("--output-special-tokens=") + (flags.output_special_tokens ? "true" : "false"),
      std::string("--default-include-stop-seqs=") +
          (flags.default_include_stop_seqs ? "true" : "false"),
      "--shutdown-grace-period",
      std::to_string(flags.shutdown_grace_period),
      "--shard-connect-timeout",
      std::to_string(flags.shard_startup_timeout + 60),
      "--shard-step-timeout",
      std::to_string(flags.shard_step_timeout)};
  router_args.insert(router_args.end(), otlp_args.begin(), otlp_args.end());  // as TGIS
  // HTTP and TLS settings reach the router through its environment.
  std::map<std::string, std::string> router_env = {{"PORT", std::to_string(flags.port)}};
  if (flags.tls_cert_path) router_env["TLS_CERT_PATH"] = *flags.tls_cert_path;
  if (flags.tls_key_path) router_env["TLS_KEY_PATH"] = *flags.tls_key_path;
  if (flags.tls_client_ca_cert_path) {
    router_env["TLS_CLIENT_CA_CERT_PATH"] = *flags.tls_client_ca_cert_path;
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
  log.Info("router started on gRPC port " + std::to_string(flags.grpc_port));
  // Wait for every shard's socket.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(flags.shard_startup_timeout);
  for (int rank = 0; rank < num_shard; ++rank) {
    const std::string socket = flags.shard_uds_path + "-" + std::to_string(rank);
    for (;;) {
      std::error_code ec;
      if (fs::exists(socket, ec)) break;
      int status;
      if (shards[rank]->Exited(&status)) {
        stop_all(routers, 5);
        stop_all(shards, 5);
        return fatal("shard " + std::to_string(rank) + " failed to start: " +
                     tgis::launcher::DescribeStatus(status) + why(*shards[rank]));
      }
      if (routers[0]->Exited(&status)) {
        stop_all(shards, 5);
        return fatal("router " + tgis::launcher::DescribeStatus(status) + why(*routers[0]));
      }
      if (g_stop_signal != 0) {
        stop_all(routers, 5);
        stop_all(shards, 5);
        return 0;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        stop_all(routers, 5);
        stop_all(shards, 5);
        return fatal("shard " + std::to_string(rank) + " did not listen on " + socket + " within " +
                     std::to_string(flags.shard_startup_timeout) + "s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    log.Info("shard " + std::to_string(rank) + " ready");
  }

  // Supervise: a stop signal drains; any child's death takes everything down.
  for (;;) {
    if (g_stop_signal != 0) {
      log.Info("received " + std::string(strsignal(g_stop_signal)) + ", draining for up to " +
               std::to_string(flags.shutdown_grace_period) + "s");
      stop_all(routers, flags.shutdown_grace_period + 5);
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

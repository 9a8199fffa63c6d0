// The launcher's command line, as TGIS's launcher (clap) has it: every flag of TGIS's Args with
// its default and its environment variable (the upper-case flag name), plus a few of ours.
// A small table-driven parser instead of gflags, so that the forms TGIS deployments use work
// (--name value, --name=value, dashes or underscores, -p/-g/-c, booleans with a value) and
// --help lists our flags, not gflags' own.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::launcher {

// The values, typed as TGIS's Args: std::optional where TGIS has Option<T> (no default).
struct LauncherFlags {
  // Model.
  std::string model_name;
  std::optional<std::string> revision;
  std::string deployment_framework;
  std::optional<std::string> dtype;
  std::optional<std::string> dtype_str;
  std::optional<std::string> quantize;
  std::optional<int64_t> num_shard;
  // Limits and batching.
  int64_t max_concurrent_requests = 0;
  std::optional<int64_t> max_sequence_length;
  int64_t max_new_tokens = 0;
  int64_t max_batch_size = 0;
  double max_prefill_padding = 0;
  int64_t batch_safety_margin = 0;
  int64_t max_waiting_tokens = 0;
  int64_t max_batch_weight = 0;
  double cuda_process_memory_fraction = 0;
  // Responses.
  bool output_special_tokens = false;
  bool default_include_stop_seqs = false;
  // Network and TLS.
  int64_t port = 0;
  int64_t grpc_port = 0;
  std::string shard_uds_path;
  std::string master_addr;
  int64_t master_port = 0;
  std::optional<std::string> tls_cert_path;
  std::optional<std::string> tls_key_path;
  std::optional<std::string> tls_client_ca_cert_path;
  // Logging and tracing.
  bool json_output = false;
  std::optional<std::string> otlp_endpoint;
  std::optional<std::string> otlp_service_name;
  // Process (ours; TGIS has none of these).
  int64_t shutdown_grace_period = 0;
  int64_t shard_startup_timeout = 0;
  int64_t shard_step_timeout = 0;
  std::string termination_log;
  std::optional<std::string> bin_dir;
};

// Reads an environment variable; nullopt when unset. Injected so tests need no setenv.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup ProcessEnv();

struct ParsedCommandLine {
  enum class Action { kRun, kHelp, kVersion };
  Action action = Action::kRun;
  LauncherFlags flags;  // filled only for kRun
};

// `args` without argv[0]. Precedence as clap's: a flag given > its environment variable >
// its default. Errors (unknown flag, missing or bad value, a flag given twice, a positional
// argument) name the flag and what it accepts.
absl::StatusOr<ParsedCommandLine> ParseLauncherFlags(const std::vector<std::string>& args,
                                                     const EnvLookup& env);

std::string LauncherHelp();
std::string LauncherVersion();
// "model_name=gpt2 revision=None ..." for the start-up log, as TGIS logs its Args.
std::string DescribeFlags(const LauncherFlags& flags);
// Shortest text that reads back as the same double ("0.2", not "0.200000").
std::string FormatNumber(double value);

// What the launcher acts on after TGIS's start-up checks.
struct LaunchSettings {
  int num_shard = 1;
  std::string dtype;              // canonical name for the shard; empty: the shard picks by device
  std::string quantize;           // --quantize for the shards; empty: the checkpoint decides
  std::vector<std::string> info;  // to log, e.g. how num_shard was found
  std::vector<std::string> warnings;  // to log, e.g. a deprecated deployment framework name
};

// TGIS's checks, with TGIS's messages where it has one: cuda_process_memory_fraction range,
// --dtype vs --dtype-str, the number of shards; and ours for values this server cannot
// honour (--quantize values, --deployment-framework, --dtype values).
absl::StatusOr<LaunchSettings> CheckLauncherFlags(const LauncherFlags& flags, const EnvLookup& env);

// TGIS's find_num_shards: --num-shard / NUM_SHARD, else NUM_GPUS, else the number of
// CUDA_VISIBLE_DEVICES (or NVIDIA_VISIBLE_DEVICES) entries, else 1. NUM_GPUS and num_shard
// must agree when both are set.
absl::StatusOr<int> FindNumShards(std::optional<int64_t> num_shard, const EnvLookup& env,
                                  std::vector<std::string>* info);

}  // namespace tgis::launcher

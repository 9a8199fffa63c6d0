#include "launcher/launcher_flags.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <type_traits>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

#ifndef TGIS_LAUNCHER_VERSION
#define TGIS_LAUNCHER_VERSION "0.1.0"
#endif

namespace tgis::launcher {

namespace {

using L = LauncherFlags;
// Where a flag's value goes; its C++ type decides how the text is parsed.
using Field = std::variant<bool L::*, int64_t L::*, std::optional<int64_t> L::*, double L::*,
                           std::string L::*, std::optional<std::string> L::*>;

enum class Group { kModel, kLimits, kResponses, kNetwork, kLogging, kProcess };
constexpr std::array<std::pair<Group, absl::string_view>, 6> kGroupTitles = {{
    {Group::kModel, "Model"},
    {Group::kLimits, "Limits and batching"},
    {Group::kResponses, "Responses"},
    {Group::kNetwork, "Network and TLS"},
    {Group::kLogging, "Logging and tracing"},
    {Group::kProcess, "Process (not in TGIS)"},
}};

// TGIS's integers are usize / u16; ours go to int32 flags of the children, hence the bound.
constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

struct FlagSpec {
  absl::string_view name = {};  // with underscores; --name and --na-me both work
  char short_name = '\0';
  absl::string_view env = {};  // empty: none
  // Parsed like a given value; empty for TGIS's Option<T> (unset unless given).
  absl::string_view default_value = {};
  Group group = Group::kModel;
  Field field = {};
  absl::string_view help = {};
  int64_t min = 0;  // integer range
  int64_t max = kIntMax;
};

// TGIS's Args, in its order within each group, then ours. The defaults are TGIS's.
const std::vector<FlagSpec>& Specs() {
  static const std::vector<FlagSpec> specs = {
      {.name = "model_name",
       .env = "MODEL_NAME",
       .default_value = "bigscience/bloom-560m",
       .group = Group::kModel,
       .field = &L::model_name,
       .help = "Model to serve: a local directory, or a hub id (org/name) in the local Hugging "
               "Face cache (HF_HUB_CACHE, HF_HOME); nothing is downloaded"},
      {.name = "revision",
       .env = "REVISION",
       .group = Group::kModel,
       .field = &L::revision,
       .help = "Revision of a hub id in the cache: commit hash, branch or tag (unset: main)"},
      {.name = "deployment_framework",
       .env = "DEPLOYMENT_FRAMEWORK",
       .default_value = "hf_transformers",
       .group = Group::kModel,
       .field = &L::deployment_framework,
       .help = "TGIS's Python inference engine: hf_transformers, tgis_native, hf_accelerate, "
               "hf_optimum_bt, hf_optimum_ort, ds_inference, ibm_fms (hf_custom_tp: old name of "
               "tgis_native). Checked, but (no effect here: this server has one engine, in C++)"},
      {.name = "dtype",
       .env = "DTYPE",
       .group = Group::kModel,
       .field = &L::dtype,
       .help = "Weight dtype: float16 (or half), bfloat16, float32 (or float); unset: bfloat16 "
               "on GPUs, float32 on the CPU. Same as --dtype-str; given both, they must be equal"},
      {.name = "dtype_str",
       .env = "DTYPE_STR",
       .group = Group::kModel,
       .field = &L::dtype_str,
       .help = "Same as --dtype (TGIS keeps both names)"},
      {.name = "quantize",
       .env = "QUANTIZE",
       .group = Group::kModel,
       .field = &L::quantize,
       .help = "Quantization: gptq, awq, fp8, compressed-tensors, auto-round, mxfp4 or "
               "bitsandbytes (a checkpoint quantized so; detected without the flag), "
               "bitsandbytes (int8 weights quantized at load), bitsandbytes-nf4 or "
               "bitsandbytes-fp4 (4-bit weights quantized at load, "
               "as TGI)"},
      {.name = "num_shard",
       .env = "NUM_SHARD",
       .group = Group::kModel,
       .field = &L::num_shard,
       .help = "Number of shards, the model tensor parallel over them. Unset: NUM_GPUS, else the "
               "number of CUDA_VISIBLE_DEVICES (or NVIDIA_VISIBLE_DEVICES) entries, else 1; "
               "NUM_GPUS and --num-shard must agree"},
      {.name = "max_concurrent_requests",
       .env = "MAX_CONCURRENT_REQUESTS",
       .default_value = "512",
       .group = Group::kLimits,
       .field = &L::max_concurrent_requests,
       .help = "Requests in the server at once; more are refused with RESOURCE_EXHAUSTED"},
      {.name = "max_sequence_length",
       .env = "MAX_SEQUENCE_LENGTH",
       .group = Group::kLimits,
       .field = &L::max_sequence_length,
       .help = "Longest input + output in tokens (unset: the model's max positions from "
               "config.json)"},
      {.name = "max_new_tokens",
       .env = "MAX_NEW_TOKENS",
       .default_value = "1024",
       .group = Group::kLimits,
       .field = &L::max_new_tokens,
       .help = "Largest max_new_tokens a request may ask for"},
      {.name = "max_batch_size",
       .env = "MAX_BATCH_SIZE",
       .default_value = "12",
       .group = Group::kLimits,
       .field = &L::max_batch_size,
       .help = "Most requests decoded together"},
      {.name = "max_prefill_padding",
       .env = "MAX_PREFILL_PADDING",
       .default_value = "0.2",
       .group = Group::kLimits,
       .field = &L::max_prefill_padding,
       .help = "Most padding a prefill batch may carry, as a fraction of its tokens (router); "
               "batches here are ragged, never padded, so only a value below 0 refuses any"},
      {.name = "batch_safety_margin",
       .env = "BATCH_SAFETY_MARGIN",
       .default_value = "20",
       .group = Group::kLimits,
       .field = &L::batch_safety_margin,
       .help = "Percent (0-100) of the free memory held back when the shards size the KV "
               "cache and the prefill limit, against running out of memory (shards)",
       .max = 100},
      {.name = "max_waiting_tokens",
       .env = "MAX_WAITING_TOKENS",
       .default_value = "24",
       .group = Group::kLimits,
       .field = &L::max_waiting_tokens,
       .help = "Decode steps after which waiting requests may interrupt decoding with their "
               "prefill"},
      {.name = "cuda_process_memory_fraction",
       .short_name = 'c',
       .env = "CUDA_PROCESS_MEMORY_FRACTION",
       .default_value = "1.0",
       .group = Group::kLimits,
       .field = &L::cuda_process_memory_fraction,
       .help = "Share of the whole GPU each shard may use, 0 < x <= 1 (shards)"},
      {.name = "max_batch_weight",
       .env = "MAX_BATCH_WEIGHT",
       .default_value = "0",
       .group = Group::kLimits,
       .field = &L::max_batch_weight,
       .help = "Most tokens the running batch may hold in the KV cache; 0: what the shards "
               "measure at warmup. Ours: TGIS ignores MAX_BATCH_WEIGHT",
       .max = std::numeric_limits<int64_t>::max()},
      {.name = "output_special_tokens",
       .env = "OUTPUT_SPECIAL_TOKENS",
       .default_value = "false",
       .group = Group::kResponses,
       .field = &L::output_special_tokens,
       .help = "Keep special tokens (e.g. EOS) in the output text"},
      {.name = "default_include_stop_seqs",
       .env = "DEFAULT_INCLUDE_STOP_SEQS",
       .default_value = "true",
       .group = Group::kResponses,
       .field = &L::default_include_stop_seqs,
       .help = "Whether output text keeps a matched stop sequence when the request does not "
               "say (e.g. --default-include-stop-seqs false)"},
      {.name = "port",
       .short_name = 'p',
       .env = "PORT",
       .default_value = "3000",
       .group = Group::kNetwork,
       .field = &L::port,
       .help = "HTTP port of /health and /metrics",
       .max = 65535},
      {.name = "grpc_port",
       .short_name = 'g',
       .env = "GRPC_PORT",
       .default_value = "8033",
       .group = Group::kNetwork,
       .field = &L::grpc_port,
       .help = "Port of the gRPC API (fmaas.GenerationService)",
       .max = 65535},
      {.name = "shard_uds_path",
       .env = "SHARD_UDS_PATH",
       .default_value = "/tmp/text-generation-server",
       .group = Group::kNetwork,
       .field = &L::shard_uds_path,
       .help = "Unix socket prefix of the shards: <path>-<rank>"},
      {.name = "master_addr",
       .env = "MASTER_ADDR",
       .default_value = "localhost",
       .group = Group::kNetwork,
       .field = &L::master_addr,
       .help = "Rendezvous address of the shards"},
      {.name = "master_port",
       .env = "MASTER_PORT",
       .default_value = "29500",
       .group = Group::kNetwork,
       .field = &L::master_port,
       .help = "Rendezvous port of the shards; one per shard group on a machine"},
      {.name = "tls_cert_path",
       .env = "TLS_CERT_PATH",
       .group = Group::kNetwork,
       .field = &L::tls_cert_path,
       .help = "Server certificate (PEM); enables TLS on the gRPC port"},
      {.name = "tls_key_path",
       .env = "TLS_KEY_PATH",
       .group = Group::kNetwork,
       .field = &L::tls_key_path,
       .help = "Private key (PEM) of the server certificate"},
      {.name = "tls_client_ca_cert_path",
       .env = "TLS_CLIENT_CA_CERT_PATH",
       .group = Group::kNetwork,
       .field = &L::tls_client_ca_cert_path,
       .help = "CA (PEM) that client certificates must chain to: mutual TLS"},
      {.name = "json_output",
       .env = "JSON_OUTPUT",
       .default_value = "false",
       .group = Group::kLogging,
       .field = &L::json_output,
       .help = "Log as JSON lines, the children's lines too"},
      {.name = "otlp_endpoint",
       .env = "OTLP_ENDPOINT",
       .group = Group::kLogging,
       .field = &L::otlp_endpoint,
       .help =
           "OpenTelemetry collector's OTLP/gRPC endpoint (http://host:4317): the router and the "
           "shards export their spans there"},
      {.name = "otlp_service_name",
       .env = "OTLP_SERVICE_NAME",
       .group = Group::kLogging,
       .field = &L::otlp_service_name,
       .help = "Service name in exported traces (router default text-generation-inference.router, "
               "shards text-generation-inference.server)"},
      {.name = "shutdown_grace_period",
       .env = "SHUTDOWN_GRACE_PERIOD",
       .default_value = "30",
       .group = Group::kProcess,
       .field = &L::shutdown_grace_period,
       .help = "Seconds in-flight requests get to finish after SIGTERM"},
      {.name = "shard_startup_timeout",
       .env = "SHARD_STARTUP_TIMEOUT",
       .default_value = "600",
       .group = Group::kProcess,
       .field = &L::shard_startup_timeout,
       .help = "Seconds to wait for a shard to listen"},
      {.name = "shard_step_timeout",
       .env = "SHARD_STEP_TIMEOUT",
       .default_value = "600",
       .group = Group::kProcess,
       .field = &L::shard_step_timeout,
       .help = "Seconds one prefill or decode step may take before its batch fails and the "
               "server turns unhealthy (a hung shard); 0: no limit"},
      {.name = "termination_log",
       .env = "TERMINATION_LOG",
       .default_value = "/dev/termination-log",
       .group = Group::kProcess,
       .field = &L::termination_log,
       .help = "Where the reason of a fatal exit is written, when writable"},
      {.name = "bin_dir",
       .group = Group::kProcess,
       .field = &L::bin_dir,
       .help = "Where text-generation-server and text-generation-router are (unset: beside "
               "the launcher)"},
  };
  return specs;
}

std::string Dashed(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

bool IsBool(const FlagSpec& spec) { return std::holds_alternative<bool L::*>(spec.field); }

// How the flag is named in a message: "--port (-p, env PORT)".
std::string Naming(const FlagSpec& spec) {
  std::vector<std::string> also;
  if (spec.short_name != '\0') also.push_back(std::string("-") + spec.short_name);
  if (!spec.env.empty()) also.push_back(absl::StrCat("env ", spec.env));
  std::string out = "--" + Dashed(spec.name);
  if (!also.empty()) absl::StrAppend(&out, " (", absl::StrJoin(also, ", "), ")");
  return out;
}

// Parses `text` into the field of `spec`; the error says what the flag accepts.
absl::Status SetValue(const FlagSpec& spec, absl::string_view text, absl::string_view source,
                      LauncherFlags* flags) {
  auto bad = [&](absl::string_view expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid value '", text, "' for ", source, ": expected ", expected));
  };
  auto parse_int = [&](int64_t* out) -> absl::Status {
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(text.data(), end, *out);
    if (text.empty() || ec != std::errc() || ptr != end || *out < spec.min || *out > spec.max) {
      return bad(absl::StrCat("an integer from ", spec.min, " to ", spec.max));
    }
    return absl::OkStatus();
  };
  return std::visit(
      [&](auto member) -> absl::Status {
        using T = std::remove_reference_t<decltype(flags->*member)>;
        if constexpr (std::is_same_v<T, bool>) {
          // clap's bool parser: exactly "true" or "false", from the command line or the env.
          if (text != "true" && text != "false") return bad("true or false");
          flags->*member = text == "true";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return parse_int(&(flags->*member));
        } else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
          int64_t v = 0;
          if (absl::Status s = parse_int(&v); !s.ok()) return s;
          flags->*member = v;
        } else if constexpr (std::is_same_v<T, double>) {
          const std::string copy(text);  // strtod needs a terminated string
          char* end = nullptr;
          const double v = std::strtod(copy.c_str(), &end);
          if (copy.empty() || end != copy.c_str() + copy.size() || !std::isfinite(v)) {
            return bad("a number");
          }
          flags->*member = v;
        } else {
          flags->*member = std::string(text);
        }
        return absl::OkStatus();
      },
      spec.field);
}

const FlagSpec* FindLong(absl::string_view name) {
  const std::string dashed = Dashed(name);
  for (const FlagSpec& spec : Specs()) {
    if (Dashed(spec.name) == dashed) return &spec;
  }
  return nullptr;
}

const FlagSpec* FindShort(char c) {
  for (const FlagSpec& spec : Specs()) {
    if (spec.short_name == c) return &spec;
  }
  return nullptr;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

absl::Status UnknownFlag(absl::string_view arg, absl::string_view name) {
  std::string message = absl::StrCat("unknown flag '", arg, "'");
  // A near miss is most likely a typo: name the flag meant.
  const std::string dashed = Dashed(name);
  const FlagSpec* best = nullptr;
  size_t best_distance = 3;
  for (const FlagSpec& spec : Specs()) {
    const size_t d = EditDistance(dashed, Dashed(spec.name));
    if (d < best_distance) best = &spec, best_distance = d;
  }
  if (best != nullptr) absl::StrAppend(&message, "; did you mean '--", Dashed(best->name), "'?");
  absl::StrAppend(&message, " (text-generation-launcher --help lists the flags)");
  return absl::InvalidArgumentError(message);
}

}  // namespace

EnvLookup ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

absl::StatusOr<ParsedCommandLine> ParseLauncherFlags(const std::vector<std::string>& args,
                                                     const EnvLookup& env) {
  ParsedCommandLine out;
  std::set<const FlagSpec*> given;
  // In order, as clap: --help or --version ends parsing where it stands.
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      out.action = ParsedCommandLine::Action::kHelp;
      return out;
    }
    if (arg == "-V" || arg == "--version") {
      out.action = ParsedCommandLine::Action::kVersion;
      return out;
    }
    const FlagSpec* spec = nullptr;
    std::string shown;  // the flag as written, for messages
    std::optional<std::string> inline_value;
    if (arg.size() > 2 && arg.starts_with("--")) {
      const size_t eq = arg.find('=');
      shown = arg.substr(0, eq);
      if (eq != std::string::npos) inline_value = arg.substr(eq + 1);
      spec = FindLong(shown.substr(2));
      if (spec == nullptr) return UnknownFlag(shown, shown.substr(2));
    } else if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-') {
      // -p 3000, -p3000 and -p=3000, as clap takes them.
      shown = arg.substr(0, 2);
      spec = FindShort(arg[1]);
      if (spec == nullptr) return UnknownFlag(shown, shown.substr(1));
      if (arg.size() > 2) inline_value = arg.substr(arg[2] == '=' ? 3 : 2);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg,
                       "': the launcher takes no positional arguments (the model is "
                       "--model-name / MODEL_NAME)"));
    }
    if (!given.insert(spec).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(Naming(*spec), " is given more than once on the command line"));
    }
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else if (IsBool(*spec)) {
      // A bare boolean flag means true; "--flag true|false" takes the next word as its value
      // (TGIS's --default-include-stop-seqs needs it that way).
      if (i + 1 < args.size() && (args[i + 1] == "true" || args[i + 1] == "false")) {
        value = args[++i];
      } else {
        value = "true";
      }
    } else if (i + 1 < args.size() && !(args[i + 1].size() > 1 && args[i + 1][0] == '-')) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("a value is required for ", Naming(*spec), " but none was supplied"));
    }
    if (absl::Status s = SetValue(*spec, value, "'" + shown + "'", &out.flags); !s.ok()) return s;
  }
  // Then, as clap: the environment for flags not given, else the default. An empty variable
  // is a value (clap's), not an unset one.
  for (const FlagSpec& spec : Specs()) {
    if (given.count(&spec) > 0) continue;
    std::optional<std::string> from_env;
    if (!spec.env.empty()) from_env = env(std::string(spec.env));
    if (from_env) {
      const std::string source = absl::StrCat(spec.env, " (--", Dashed(spec.name), ")");
      if (absl::Status s = SetValue(spec, *from_env, source, &out.flags); !s.ok()) return s;
    } else if (!spec.default_value.empty()) {
      absl::Status s = SetValue(spec, spec.default_value, "the default", &out.flags);
      if (!s.ok()) return absl::InternalError(s.message());  // a bug in the table
    }
  }
  return out;
}

std::string LauncherVersion() {
  return absl::StrCat("text-generation-launcher ", TGIS_LAUNCHER_VERSION, "\n");
}

std::string LauncherHelp() {
  std::string out = absl::StrCat(
      "text-generation-launcher: resolves the model, starts the shards (text-generation-server)\n"
      "and the router (text-generation-router), and supervises them. The flags and environment\n"
      "variables are TGIS's launcher's.\n\n"
      "Usage: text-generation-launcher [OPTIONS]\n\n"
      "Every option can also be set by its environment variable; a flag given wins over the\n"
      "variable, the variable over the default. Values: --name value or --name=value; dashes or\n"
      "underscores. Booleans: --flag, --flag=true|false or --flag true|false.\n");
  for (const auto& [group, title] : kGroupTitles) {
    absl::StrAppend(&out, "\n", title, ":\n");
    for (const FlagSpec& spec : Specs()) {
      if (spec.group != group) continue;
      std::string line = "  ";
      absl::StrAppend(&line, spec.short_name != '\0' ? std::string("-") + spec.short_name + ", "
                                                     : std::string("    "));
      absl::StrAppend(&line, "--", Dashed(spec.name));
      if (IsBool(spec)) {
        absl::StrAppend(&line, " [<true|false>]");
      } else {
        absl::StrAppend(&line, " <", spec.env.empty() ? "PATH" : spec.env, ">");
      }
      std::string where;
      if (!spec.env.empty()) absl::StrAppend(&where, "[env: ", spec.env, "]");
      if (!spec.default_value.empty()) {
        absl::StrAppend(&where, where.empty() ? "" : " ", "[default: ", spec.default_value, "]");
      }
      // On the flag's line when it fits, else on its own.
      if (!where.empty()) {
        absl::StrAppend(&line, line.size() + 2 + where.size() <= 92 ? "  " : "\n          ", where);
      }
      absl::StrAppend(&out, line, "\n");
      // The help text wrapped at 92 columns under the flag.
      std::string wrapped = "          ";
      size_t column = wrapped.size();
      for (absl::string_view word : absl::StrSplit(spec.help, ' ')) {
        if (column + 1 + word.size() > 92 && column > 10) {
          absl::StrAppend(&wrapped, "\n          ");
          column = 10;
        } else if (column > 10) {
          absl::StrAppend(&wrapped, " ");
          ++column;
        }
        absl::StrAppend(&wrapped, word);
        column += word.size();
      }
      absl::StrAppend(&out, wrapped, "\n");
    }
  }
  absl::StrAppend(&out,
                  "\nOther:\n"
                  "  -h, --help     Print this help\n"
                  "  -V, --version  Print the version\n\n"
                  "The children inherit the environment: HF_HUB_CACHE / HF_HOME, TGIS_DEVICE,\n"
                  "KV_CACHE_MEMORY_FRACTION, PREFIX_STORE_PATH and the like reach them as set.\n");
  return out;
}

std::string FormatNumber(double value) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  return ec == std::errc() ? std::string(buf, ptr) : std::to_string(value);
}

std::string DescribeFlags(const LauncherFlags& flags) {
  std::vector<std::string> parts;
  for (const FlagSpec& spec : Specs()) {
    std::string value = std::visit(
        [&](auto member) -> std::string {
          const auto& v = flags.*member;
          using T = std::remove_cvref_t<decltype(v)>;
          if constexpr (std::is_same_v<T, bool>) {
            return v ? "true" : "false";
          } else if constexpr (std::is_same_v<T, int64_t>) {
            return std::to_string(v);
          } else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
            return v ? std::to_string(*v) : "None";
          } else if constexpr (std::is_same_v<T, double>) {
            return FormatNumber(v);
          } else if constexpr (std::is_same_v<T, std::string>) {
            return v;
          } else {
            return v ? *v : "None";
          }
        },
        spec.field);
    parts.push_back(absl::StrCat(spec.name, "=", value));
  }
  return absl::StrJoin(parts, " ");
}

absl::StatusOr<int> FindNumShards(std::optional<int64_t> num_shard, const EnvLookup& env,
                                  std::vector<std::string>* info) {
  std::optional<int64_t> num_gpus;
  if (std::optional<std::string> text = env("NUM_GPUS")) {
    int64_t v = 0;
    const char* end = text->data() + text->size();
    auto [ptr, ec] = std::from_chars(text->data(), end, v);
    if (text->empty() || ec != std::errc() || ptr != end || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUM_GPUS must be a positive integer (it is '", *text, "')"));
    }
    num_gpus = v;
  }
  int64_t n = 1;
  if (num_gpus && num_shard) {
    if (*num_gpus != *num_shard) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUM_GPUS and num_shard are set to different "
                       "values (",
                       *num_gpus, " and ", *num_shard, ")"));
    }
    n = *num_shard;
  } else if (num_gpus) {
    n = *num_gpus;
  } else if (num_shard) {
    n = *num_shard;
  } else {
    // As TGIS: one shard per visible GPU. Like Rust's split(','), "" and "all" count as one.
    std::optional<std::string> devices = env("CUDA_VISIBLE_DEVICES");
    if (!devices) devices = env("NVIDIA_VISIBLE_DEVICES");
    if (devices) {
      n = std::count(devices->begin(), devices->end(), ',') + 1;
      info->push_back(absl::StrCat("Inferring num_shard = ", n,
                                   " from CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES"));
    } else {
      info->push_back("Defaulting num_shard to 1");
    }
  }
  if (n < 1) return absl::InvalidArgumentError("`num_shard` / NUM_GPUS cannot be < 1");
  if (n > kIntMax)
    return absl::InvalidArgumentError(absl::StrCat("num_shard ", n, " is too large"));
  return static_cast<int>(n);
}

absl::StatusOr<LaunchSettings> CheckLauncherFlags(const LauncherFlags& flags,
                                                  const EnvLookup& env) {
  LaunchSettings settings;
  const double fraction = flags.cuda_process_memory_fraction;
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cuda-process-memory-fraction (-c, env CUDA_PROCESS_MEMORY_FRACTION) is ",
        FormatNumber(fraction), ": cuda_process_memory_fraction must be in range 0 < x <= 1"));
  }
  if (flags.dtype && flags.dtype_str && *flags.dtype != *flags.dtype_str) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype and dtype_str args both provided with different values (--dtype '",
                     *flags.dtype, "', --dtype-str '", *flags.dtype_str, "')"));
  }
  absl::StatusOr<int> shards = FindNumShards(flags.num_shard, env, &settings.info);
  if (!shards.ok()) return shards.status();
  settings.num_shard = *shards;

  // TGIS's engines are the modules of text_generation_server/inference_engine/; the choice
  // is the Python server's, so here it is only checked.
  static constexpr std::array<absl::string_view, 7> kFrameworks = {
      "hf_transformers", "tgis_native",  "hf_accelerate", "hf_optimum_bt",
      "hf_optimum_ort",  "ds_inference", "ibm_fms"};
  if (flags.deployment_framework == "hf_custom_tp") {
    settings.warnings.push_back(
        "The \"hf_custom_tp\" deployment engine name is deprecated, please use \"tgis_native\"");
  } else if (std::find(kFrameworks.begin(), kFrameworks.end(), flags.deployment_framework) ==
             kFrameworks.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--deployment-framework (env DEPLOYMENT_FRAMEWORK) '", flags.deployment_framework,
        "' is not one of TGIS's: ", absl::StrJoin(kFrameworks, ", "),
        " (or hf_custom_tp); it chooses TGIS's Python engine and has no effect here"));
  }

  // TGIS's values (gptq, bitsandbytes) and ours; the shard checks them against the checkpoint
  // (server/quantization.h).
  static const std::vector<std::string> kQuantize = {
      "gptq", "bitsandbytes", "bitsandbytes-nf4",   "bitsandbytes-fp4",
      "awq",  "fp8",          "compressed-tensors", "auto-round",
      "mxfp4"};
  if (flags.quantize) {
    if (std::find(kQuantize.begin(), kQuantize.end(), *flags.quantize) == kQuantize.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quantize (env QUANTIZE) '", *flags.quantize,
          "' is not a quantization method; accepted values: ", absl::StrJoin(kQuantize, ", ")));
    }
    settings.quantize = *flags.quantize;
  }

  // TGIS takes any torch dtype name; these are the ones the shards have, with torch's aliases.
  const std::optional<std::string>& dtype = flags.dtype ? flags.dtype : flags.dtype_str;
  if (dtype) {
    const absl::string_view flag =
        flags.dtype ? "--dtype (env DTYPE)" : "--dtype-str (env DTYPE_STR)";
    static const std::map<std::string, std::string, std::less<>> kDtypes = {
        {"float16", "float16"},
        {"half", "float16"},
        {"bfloat16", "bfloat16"},
        {"float32", "float32"},
        {"float", "float32"}};
    if (auto it = kDtypes.find(*dtype); it != kDtypes.end()) {
      settings.dtype = it->second;
    } else if (*dtype == "int8") {
      // TGIS reads dtype int8 as quantize=bitsandbytes (when --quantize is unset).
      if (settings.quantize.empty()) settings.quantize = "bitsandbytes";
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " '", *dtype,
                       "' is not a supported dtype; accepted values: float16 (or half), bfloat16, "
                       "float32 (or float)"));
    }
  }
  return settings;
}

}  // namespace tgis::launcher

// The launcher's command line as TGIS's (clap) has it: forms, environment fallbacks,
// precedence, booleans, errors that name the flag, TGIS's start-up checks and NUM_SHARD.
#include "launcher/launcher_flags.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace {

using tgis::launcher::CheckLauncherFlags;
using tgis::launcher::EnvLookup;
using tgis::launcher::FindNumShards;
using tgis::launcher::LauncherFlags;
using tgis::launcher::LauncherHelp;
using tgis::launcher::ParsedCommandLine;
using tgis::launcher::ParseLauncherFlags;

// gmock is not linked here: a substring check that shows the whole text when it fails.
#define EXPECT_HAS(text, part)                                                                \
  do {                                                                                        \
    const std::string t_ = std::string(text);                                                 \
    EXPECT_NE(t_.find(part), std::string::npos) << "'" << t_ << "' lacks '" << (part) << "'"; \
  } while (0)

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

LauncherFlags Parse(const std::vector<std::string>& args,
                    std::map<std::string, std::string> env = {}) {
  auto parsed = ParseLauncherFlags(args, Env(std::move(env)));
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (!parsed.ok()) return {};
  EXPECT_EQ(parsed->action, ParsedCommandLine::Action::kRun);
  return parsed->flags;
}

std::string ParseError(const std::vector<std::string>& args,
                       std::map<std::string, std::string> env = {}) {
  auto parsed = ParseLauncherFlags(args, Env(std::move(env)));
  EXPECT_FALSE(parsed.ok());
  return parsed.ok() ? "" : std::string(parsed.status().message());
}

std::string CheckError(const std::vector<std::string>& args,
                       std::map<std::string, std::string> env = {}) {
  auto check = CheckLauncherFlags(Parse(args, env), Env(env));
  EXPECT_FALSE(check.ok());
  return check.ok() ? "" : std::string(check.status().message());
}

TEST(LauncherFlagsTest, DefaultsAreTgis) {
  const LauncherFlags f = Parse({});
  EXPECT_EQ(f.model_name, "bigscience/bloom-560m");
  EXPECT_FALSE(f.revision);
  EXPECT_EQ(f.deployment_framework, "hf_transformers");
  EXPECT_FALSE(f.dtype);
  EXPECT_FALSE(f.dtype_str);
  EXPECT_FALSE(f.quantize);
  EXPECT_FALSE(f.num_shard);
  EXPECT_EQ(f.max_concurrent_requests, 512);
  EXPECT_FALSE(f.max_sequence_length);
  EXPECT_EQ(f.max_new_tokens, 1024);
  EXPECT_EQ(f.max_batch_size, 12);
  EXPECT_DOUBLE_EQ(f.max_prefill_padding, 0.2);
  EXPECT_EQ(f.batch_safety_margin, 20);
  EXPECT_EQ(f.max_waiting_tokens, 24);
  EXPECT_EQ(f.port, 3000);
  EXPECT_EQ(f.grpc_port, 8033);
  EXPECT_EQ(f.shard_uds_path, "/tmp/text-generation-server");
  EXPECT_EQ(f.master_addr, "localhost");
  EXPECT_EQ(f.master_port, 29500);
  EXPECT_FALSE(f.json_output);
  EXPECT_FALSE(f.tls_cert_path);
  EXPECT_FALSE(f.output_special_tokens);
  EXPECT_DOUBLE_EQ(f.cuda_process_memory_fraction, 1.0);
  EXPECT_TRUE(f.default_include_stop_seqs);
  EXPECT_FALSE(f.otlp_endpoint);
  EXPECT_EQ(f.shutdown_grace_period, 30);
  EXPECT_EQ(f.termination_log, "/dev/termination-log");
}

TEST(LauncherFlagsTest, EveryForm) {
  const LauncherFlags f = Parse({"--model-name", "m1", "--max_batch_size=7", "--max-new-tokens=9",
                                 "-p", "1234", "-g4321", "-c=0.5", "--dtype_str", "float32",
                                 "--revision=", "--max-prefill-padding", "0.25"});
  EXPECT_EQ(f.model_name, "m1");
  EXPECT_EQ(f.max_batch_size, 7);
  EXPECT_EQ(f.max_new_tokens, 9);
  EXPECT_EQ(f.port, 1234);
  EXPECT_EQ(f.grpc_port, 4321);
  EXPECT_DOUBLE_EQ(f.cuda_process_memory_fraction, 0.5);
  EXPECT_EQ(f.dtype_str, "float32");
  EXPECT_EQ(f.revision, "");
  EXPECT_DOUBLE_EQ(f.max_prefill_padding, 0.25);
}

TEST(LauncherFlagsTest, EnvironmentFallbackAndPrecedence) {
  const std::map<std::string, std::string> env = {{"MODEL_NAME", "from-env"},
                                                  {"MAX_BATCH_SIZE", "5"},
                                                  {"DEPLOYMENT_FRAMEWORK", "tgis_native"},
                                                  {"DTYPE", "bfloat16"},
                                                  {"QUANTIZE", "gptq"},
                                                  {"CUDA_PROCESS_MEMORY_FRACTION", "0.7"},
                                                  {"OTLP_ENDPOINT", "http://c:4317"},
                                                  {"BATCH_SAFETY_MARGIN", "30"},
                                                  {"GRPC_PORT", "9000"}};
  const LauncherFlags from_env = Parse({}, env);
  EXPECT_EQ(from_env.model_name, "from-env");
  EXPECT_EQ(from_env.max_batch_size, 5);
  EXPECT_EQ(from_env.deployment_framework, "tgis_native");
  EXPECT_EQ(from_env.dtype, "bfloat16");
  EXPECT_EQ(from_env.quantize, "gptq");
  EXPECT_DOUBLE_EQ(from_env.cuda_process_memory_fraction, 0.7);
  EXPECT_EQ(from_env.otlp_endpoint, "http://c:4317");
  EXPECT_EQ(from_env.batch_safety_margin, 30);
  EXPECT_EQ(from_env.grpc_port, 9000);
  // A flag given wins over its variable; the rest still come from the environment.
  const LauncherFlags flag_wins = Parse({"--model-name", "from-flag", "-g", "9100"}, env);
  EXPECT_EQ(flag_wins.model_name, "from-flag");
  EXPECT_EQ(flag_wins.grpc_port, 9100);
  EXPECT_EQ(flag_wins.max_batch_size, 5);
}

TEST(LauncherFlagsTest, Booleans) {
  EXPECT_TRUE(Parse({"--json-output"}).json_output);
  EXPECT_TRUE(Parse({"--json-output=true"}).json_output);
  EXPECT_FALSE(Parse({"--json-output=false"}).json_output);
  EXPECT_TRUE(Parse({"--json_output", "true"}).json_output);
  // The value after a boolean is taken only when it is true or false.
  const LauncherFlags f =
      Parse({"--default-include-stop-seqs", "false", "--output-special-tokens", "--port", "1"});
  EXPECT_FALSE(f.default_include_stop_seqs);
  EXPECT_TRUE(f.output_special_tokens);
  EXPECT_EQ(f.port, 1);
  EXPECT_TRUE(Parse({"--default-include-stop-seqs", "true"}).default_include_stop_seqs);
  // From the environment as clap's bool parser: exactly true or false.
  EXPECT_TRUE(Parse({}, {{"JSON_OUTPUT", "true"}}).json_output);
  EXPECT_FALSE(Parse({}, {{"JSON_OUTPUT", "false"}}).json_output);
  EXPECT_FALSE(Parse({}, {{"DEFAULT_INCLUDE_STOP_SEQS", "false"}}).default_include_stop_seqs);
  EXPECT_HAS(ParseError({}, {{"JSON_OUTPUT", "1"}}),
             "invalid value '1' for JSON_OUTPUT (--json-output): expected true or "
             "false");
  EXPECT_HAS(ParseError({"--output-special-tokens=yes"}),
             "'--output-special-tokens': expected true or false");
}

TEST(LauncherFlagsTest, ErrorsNameTheFlag) {
  EXPECT_HAS(ParseError({"--no-such-flag", "1"}), "unknown flag '--no-such-flag'");
  EXPECT_HAS(ParseError({"--max-batch-sise=3"}),
             "unknown flag '--max-batch-sise'; did you mean '--max-batch-size'?");
  EXPECT_HAS(ParseError({"-x"}), "unknown flag '-x'");
  EXPECT_HAS(ParseError({"gpt2"}), "unexpected argument 'gpt2'");
  EXPECT_HAS(ParseError({"--port", "http"}),
             "invalid value 'http' for '--port': expected an integer from 0 to 65535");
  EXPECT_HAS(ParseError({"-p", "70000"}), "'-p': expected an integer from 0 to 65535");
  EXPECT_HAS(ParseError({"--max-batch-size", "-3"}),
             "a value is required for --max-batch-size (env MAX_BATCH_SIZE)");
  EXPECT_HAS(ParseError({"--max-new-tokens"}), "a value is required");
  EXPECT_HAS(ParseError({"--max-prefill-padding", "lots"}),
             "'--max-prefill-padding': expected a number");
  EXPECT_HAS(ParseError({}, {{"MAX_BATCH_SIZE", ""}}),
             "invalid value '' for MAX_BATCH_SIZE (--max-batch-size)");
  EXPECT_HAS(ParseError({"--batch-safety-margin", "150"}), "expected an integer from 0 to 100");
  EXPECT_HAS(ParseError({"--port", "1", "-p", "2"}), "given more than once");
}

TEST(LauncherFlagsTest, HelpAndVersion) {
  auto help = ParseLauncherFlags({"--port", "1", "--help", "--bogus"}, Env({}));
  ASSERT_TRUE(help.ok());
  EXPECT_EQ(help->action, ParsedCommandLine::Action::kHelp);
  // --help needs no valid environment.
  auto help_bad_env = ParseLauncherFlags({"-h"}, Env({{"PORT", "x"}}));
  ASSERT_TRUE(help_bad_env.ok());
  EXPECT_EQ(help_bad_env->action, ParsedCommandLine::Action::kHelp);
  auto version = ParseLauncherFlags({"-V"}, Env({}));
  ASSERT_TRUE(version.ok());
  EXPECT_EQ(version->action, ParsedCommandLine::Action::kVersion);

  const std::string text = LauncherHelp();
  for (const char* entry :
       {"--model-name <MODEL_NAME>  [env: MODEL_NAME] [default: bigscience/bloom-560m]",
        "--deployment-framework <DEPLOYMENT_FRAMEWORK>\n"
        "          [env: DEPLOYMENT_FRAMEWORK] [default: hf_transformers]",
        "-p, --port <PORT>  [env: PORT] [default: 3000]",
        "-g, --grpc-port <GRPC_PORT>  [env: GRPC_PORT] [default: 8033]",
        "-c, --cuda-process-memory-fraction <CUDA_PROCESS_MEMORY_FRACTION>",
        "--default-include-stop-seqs [<true|false>]\n"
        "          [env: DEFAULT_INCLUDE_STOP_SEQS] [default: true]",
        "[env: MAX_CONCURRENT_REQUESTS] [default: 512]", "no effect here",
        "Model:", "Limits and batching:", "Network and TLS:", "Logging and tracing:"}) {
    EXPECT_HAS(text, entry);
  }
  // Not gflags' list.
  EXPECT_EQ(text.find("flagfile"), std::string::npos);
}

TEST(LauncherFlagsTest, TgisChecks) {
  EXPECT_HAS(CheckError({"-c", "1.5"}), "cuda_process_memory_fraction must be in range 0 < x <= 1");
  EXPECT_HAS(CheckError({}, {{"CUDA_PROCESS_MEMORY_FRACTION", "0"}}),
             "--cuda-process-memory-fraction");
  EXPECT_HAS(CheckError({"--dtype", "float16", "--dtype-str", "bfloat16"}),
             "dtype and dtype_str args both provided with different values");
  EXPECT_HAS(CheckError({"--dtype", "float64"}),
             "--dtype (env DTYPE) 'float64' is not a supported dtype; accepted values: "
             "float16 (or half), bfloat16, float32 (or float)");
  EXPECT_HAS(CheckError({}, {{"DTYPE_STR", "fp16"}}), "--dtype-str (env DTYPE_STR)");
  EXPECT_HAS(CheckError({"--quantize", "gptq-v9"}),
             "--quantize (env QUANTIZE) 'gptq-v9' is not a quantization method; accepted "
             "values: gptq, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, awq, fp8, "
             "compressed-tensors, auto-round, mxfp4");
  EXPECT_HAS(CheckError({}, {{"QUANTIZE", "fp4"}}), "(env QUANTIZE)");
  EXPECT_HAS(CheckError({"--deployment-framework", "vllm"}),
             "--deployment-framework (env DEPLOYMENT_FRAMEWORK) 'vllm' is not one of "
             "TGIS's: hf_transformers, tgis_native");

  auto ok = CheckLauncherFlags(
      Parse({"--dtype", "half", "--dtype-str", "half", "--deployment-framework", "hf_custom_tp"}),
      Env({}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->dtype, "float16");
  EXPECT_EQ(ok->num_shard, 1);
  ASSERT_EQ(ok->warnings.size(), 1u);
  EXPECT_HAS(ok->warnings[0], "deprecated");
  // TGIS reads --dtype-str int8 as --quantize bitsandbytes; an explicit --quantize wins.
  auto int8 = CheckLauncherFlags(Parse({"--dtype-str", "int8"}), Env({}));
  ASSERT_TRUE(int8.ok()) << int8.status();
  EXPECT_EQ(int8->quantize, "bitsandbytes");
  EXPECT_EQ(int8->dtype, "");
  auto gptq = CheckLauncherFlags(Parse({"--quantize", "gptq"}), Env({}));
  ASSERT_TRUE(gptq.ok()) << gptq.status();
  EXPECT_EQ(gptq->quantize, "gptq");
  auto unset = CheckLauncherFlags(Parse({}), Env({}));
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->dtype, "");  // the shard picks by device
}

TEST(LauncherFlagsTest, NumShardAsTgisFindsIt) {
  std::vector<std::string> info;
  auto n = [&](std::optional<int64_t> flag, std::map<std::string, std::string> env) {
    info.clear();
    return FindNumShards(flag, Env(std::move(env)), &info);
  };
  EXPECT_EQ(*n(std::nullopt, {}), 1);
  EXPECT_EQ(info, std::vector<std::string>{"Defaulting num_shard to 1"});
  EXPECT_EQ(*n(3, {}), 3);
  EXPECT_EQ(*n(std::nullopt, {{"NUM_GPUS", "4"}}), 4);
  EXPECT_EQ(*n(2, {{"NUM_GPUS", "2"}}), 2);
  EXPECT_EQ(*n(std::nullopt, {{"CUDA_VISIBLE_DEVICES", "0,1,3"}}), 3);
  EXPECT_HAS(info[0], "Inferring num_shard = 3 from CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(*n(std::nullopt, {{"NVIDIA_VISIBLE_DEVICES", "0,1"}}), 2);
  // CUDA_VISIBLE_DEVICES first; NUM_SHARD / NUM_GPUS over both.
  EXPECT_EQ(*n(std::nullopt, {{"CUDA_VISIBLE_DEVICES", "0"}, {"NVIDIA_VISIBLE_DEVICES", "0,1"}}),
            1);
  EXPECT_EQ(*n(2, {{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}), 2);
  EXPECT_HAS(n(2, {{"NUM_GPUS", "4"}}).status().message(),
             "NUM_GPUS and num_shard are set to different values (4 and 2)");
  EXPECT_HAS(n(std::nullopt, {{"NUM_GPUS", "two"}}).status().message(),
             "NUM_GPUS must be a positive integer");
  EXPECT_HAS(n(0, {}).status().message(), "`num_shard` / NUM_GPUS cannot be < 1");
  EXPECT_HAS(n(std::nullopt, {{"NUM_GPUS", "0"}}).status().message(), "cannot be < 1");
  // Through the parser: NUM_SHARD is the flag's variable.
  auto settings = CheckLauncherFlags(Parse({}, {{"NUM_SHARD", "2"}}), Env({{"NUM_SHARD", "2"}}));
  ASSERT_TRUE(settings.ok());
  EXPECT_EQ(settings->num_shard, 2);
}

TEST(LauncherFlagsTest, DescribeAndNumbers) {
  const std::string described = tgis::launcher::DescribeFlags(Parse({"--revision", "abc"}));
  EXPECT_HAS(described, "model_name=bigscience/bloom-560m revision=abc");
  EXPECT_HAS(described, "max_prefill_padding=0.2 ");
  EXPECT_HAS(described, "quantize=None");
  EXPECT_EQ(tgis::launcher::FormatNumber(0.2), "0.2");
  EXPECT_EQ(tgis::launcher::FormatNumber(1.0), "1");
}

}  // namespace

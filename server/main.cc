// text-generation-server: one model shard serving proto/generate.proto on a unix socket.
//
//   text-generation-server serve MODEL_DIR --uds-path /tmp/text-generation-server
//       [--dtype float32|bfloat16] [--rank 0 --world-size 1] [--kv-cache-blocks N]
//
// and TGIS's operator commands (cli_tools.h): download-weights, convert-to-safetensors.
//
// With --world-size N > 1 the N shards (ranks 0..N-1) each load their slice of the model and run
// every step together over a Communicator (Gloo on the CPU, NCCL on CUDA), meeting first through
// the rendezvous directory of MASTER_ADDR:MASTER_PORT.
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <grpcpp/grpcpp.h>
#include <sys/prctl.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/env_flags.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/cli_tools.h"
#include "server/gloo_communicator.h"
#include "server/model_registry.h"
#include "server/nccl_communicator.h"
#include "server/quantization.h"
#include "server/shard_service.h"
#include "tracing/tracing.h"

DEFINE_string(uds_path, "/tmp/text-generation-server",
              "Unix socket path prefix; shard N listens on <path>-N (env SHARD_UDS_PATH)");
DEFINE_string(dtype, "auto",
              "Weight dtype: float32, bfloat16, float16, or auto: float32 on the CPU, bfloat16 "
              "on CUDA (env DTYPE_STR)");
DEFINE_int32(rank, 0, "This shard's rank (env RANK)");
DEFINE_int32(world_size, 1, "Number of shards (env WORLD_SIZE)");
DEFINE_string(master_addr, "localhost",
              "Shard group address; rank 0's TCP device listens there (env MASTER_ADDR)");
DEFINE_int32(master_port, 29500, "Shard group port: names the rendezvous (env MASTER_PORT)");
DEFINE_string(rendezvous_dir, "",
              "Directory where the shards of a group meet; default <tmp>/tgis-rendezvous-"
              "<master addr>-<master port> (env TGIS_RENDEZVOUS_DIR)");
DEFINE_int32(collective_timeout, 300,
             "Seconds to wait for the other shards at the rendezvous and in each collective "
             "(env TGIS_COLLECTIVE_TIMEOUT)");
DEFINE_int32(kv_cache_blocks, 0,
             "KV cache blocks; 0 sizes the cache from free memory at Warmup (env KV_CACHE_BLOCKS)");
DEFINE_int32(block_size, 16, "Tokens per KV cache block (env KV_CACHE_BLOCK_SIZE)");
DEFINE_double(memory_fraction, 0.3,
              "Fraction of available memory for the KV cache: host memory on the CPU, free GPU "
              "memory after the weights on CUDA, where the default is 0.85 "
              "(env KV_CACHE_MEMORY_FRACTION)");
DEFINE_double(cuda_process_memory_fraction, 1.0,
              "Share of the whole GPU this shard may use, 0 < x <= 1; the KV cache leaves the "
              "rest to other processes (env CUDA_PROCESS_MEMORY_FRACTION)");
DEFINE_int32(batch_safety_margin, 20,
             "Percent of the free memory held back when sizing the KV cache and the prefill "
             "limit, 0-100 (env BATCH_SAFETY_MARGIN)");
DEFINE_string(prefix_store_path, "",
              "Folder of adapters, one sub-folder per prefix/adapter id: prompt-tuning prefixes "
              "(decoder.pt or a PEFT prompt-tuning adapter) and PEFT LoRA adapters; empty: "
              "none (env PREFIX_STORE_PATH, else ADAPTER_CACHE as the vllm-tgis-adapter names "
              "it)");
DEFINE_double(prompt_cache_size_mb, 512,
              "MiB of prefixes kept loaded, least recently used evicted first "
              "(env PROMPT_CACHE_SIZE_MB)");
DEFINE_bool(prefix_caching, true,
            "Keep the keys and values of full KV cache blocks after a request ends and share them "
            "with later prompts that start with the same tokens, which then compute only the "
            "rest; outputs are unchanged (env PREFIX_CACHING)");
DEFINE_string(
    quantize, "",
    "Quantization: gptq, awq, fp8, compressed-tensors, auto-round or bitsandbytes (the "
    "checkpoint's own; "
    "detected without the flag), bitsandbytes (int8 weights quantized at load, per output "
    "row), bitsandbytes-nf4 or bitsandbytes-fp4 (4-bit codes in blocks of 64 quantized at "
    "load); empty: what the checkpoint says (env QUANTIZE)");
DEFINE_bool(
    cpu_int8_activations, false,
    "CPU, 8- and 4-bit integer weights (GPTQ, AWQ, bitsandbytes int8): prefill and decode multiply "
    "them by activations rounded to int8 per 32 columns, as llama.cpp and "
    "CTranslate2 do (AVX2, or AVX-512 VNNI where present): faster, and outputs move by "
    "that rounding; "
    "off: exact f32 activations (env CPU_INT8_ACTIVATIONS)");
DEFINE_bool(cuda_graphs, true,
            "CUDA: decode steps of up to 64 sequences replay a graph captured per batch and "
            "context size bucket (one launch per step instead of one per kernel); outputs are "
            "unchanged; no effect on the CPU (env CUDA_GRAPHS)");
DEFINE_string(decode_ahead, "auto",
              "true: after answering a decode step, start the next one for the sequences the "
              "router cannot have finished, while it handles the answer (their tokens are the "
              "same); false: every step waits for the router's call; auto: true on CUDA, false "
              "on the CPU, where the step and the router share the cores (env DECODE_AHEAD)");
DEFINE_string(otlp_endpoint, "",
              "OpenTelemetry collector's OTLP/gRPC endpoint (http://host:4317); empty: no "
              "tracing (env OTLP_ENDPOINT)");
DEFINE_string(otlp_service_name, "text-generation-inference.server",
              "service.name of the exported spans (env OTLP_SERVICE_NAME)");
DEFINE_string(device, "auto",
              "Where the model runs: cpu, cuda (GPU number = rank), or auto: cuda when this "
              "build has CUDA and a GPU is present (env TGIS_DEVICE)");

namespace {

std::unique_ptr<grpc::Server> g_server;

void OnSignal(int) {
  if (g_server) {
    std::thread([] {
      g_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }).detach();
  }
}

int Fail(const std::string& message) {
  LOG(ERROR) << message;
  std::fprintf(stderr, "text-generation-server: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && (std::string(argv[1]) == "download-weights" ||
                    std::string(argv[1]) == "convert-to-safetensors")) {
    FLAGS_logtostderr = true;
    google::InitGoogleLogging(argv[0]);
    return std::string(argv[1]) == "download-weights"
               ? tgis::server::RunDownloadWeights(argc, argv)
               : tgis::server::RunConvertToSafetensors(argc, argv);
  }
  gflags::SetUsageMessage(
      "serve MODEL_DIR --uds-path PATH [--dtype float32|bfloat16] [--rank R --world-size N]");
  tgis::NormalizeDashedFlags(argc, argv);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  if (std::string err =
          tgis::ApplyEnvFallbacks({{"uds_path", "SHARD_UDS_PATH"},
                                   {"dtype", "DTYPE_STR"},
                                   {"rank", "RANK"},
                                   {"world_size", "WORLD_SIZE"},
                                   {"master_addr", "MASTER_ADDR"},
                                   {"master_port", "MASTER_PORT"},
                                   {"rendezvous_dir", "TGIS_RENDEZVOUS_DIR"},
                                   {"collective_timeout", "TGIS_COLLECTIVE_TIMEOUT"},
                                   {"kv_cache_blocks", "KV_CACHE_BLOCKS"},
                                   {"block_size", "KV_CACHE_BLOCK_SIZE"},
                                   {"memory_fraction", "KV_CACHE_MEMORY_FRACTION"},
                                   {"device", "TGIS_DEVICE"},
                                   {"cuda_process_memory_fraction", "CUDA_PROCESS_MEMORY_FRACTION"},
                                   {"batch_safety_margin", "BATCH_SAFETY_MARGIN"},
                                   {"prefix_store_path", "PREFIX_STORE_PATH"},
                                   {"prompt_cache_size_mb", "PROMPT_CACHE_SIZE_MB"},
                                   {"prefix_caching", "PREFIX_CACHING"},
                                   {"quantize", "QUANTIZE"},
                                   {"cpu_int8_activations", "CPU_INT8_ACTIVATIONS"},
                                   {"cuda_graphs", "CUDA_GRAPHS"},
                                   {"decode_ahead", "DECODE_AHEAD"},
                                   {"otlp_endpoint", "OTLP_ENDPOINT"},
                                   {"otlp_service_name", "OTLP_SERVICE_NAME"}});
      !err.empty()) {
    return Fail(err);
  }
  // The vllm-tgis-adapter's name for the same folder, for deployments that set that one.
  if (const char* cache = std::getenv("ADAPTER_CACHE");
      FLAGS_prefix_store_path.empty() && cache != nullptr && *cache != '\0') {
    FLAGS_prefix_store_path = cache;
  }
  if (argc != 3 || std::string(argv[1]) != "serve") {
    return Fail(
        "usage: text-generation-server serve MODEL_DIR --uds-path PATH | download-weights "
        "MODEL_NAME ... | convert-to-safetensors MODEL_NAME ...");
  }
  // Before any other thread starts (it sets OpenBLAS's environment, then loads it).
  const bool int8_activations =
      FLAGS_cpu_int8_activations && tgis::kernels::SetCpuInt8Activations(true);
  if (FLAGS_cpu_int8_activations && !int8_activations) {
    LOG(WARNING) << "--cpu-int8-activations (CPU_INT8_ACTIVATIONS) is set, but this CPU has no "
                    "AVX2: 8- and 4-bit weights keep exact f32 activations";
  }
  // The launcher starts every rank on this host: each takes its share of the CPUs, where each
  // taking all of them would run world-size times as many threads as there are cores
  // (TGIS_CPU_THREADS, when set, still decides: the pool reads it over any size set here).
  if (FLAGS_world_size > 1) {
    tgis::kernels::SetCpuThreads(std::max(1, tgis::kernels::CpusAvailable() / FLAGS_world_size));
  }
  LOG(INFO) << "CPU kernels: " << tgis::kernels::CpuBackendSummary()
            << (int8_activations ? ", int8 activations for 8- and 4-bit weights" : "");
  auto tracing =
      tgis::tracing::TracingSession::FromFlags(FLAGS_otlp_endpoint, FLAGS_otlp_service_name);
  if (!tracing.ok()) return Fail(std::string(tracing.status().message()));
  // Exit with the parent (the launcher): no orphaned shard.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  const std::string model_dir = argv[2];
  // At world size 1 the rank only names the socket (independent shards side by side).
  if (FLAGS_world_size < 1 || FLAGS_rank < 0 ||
      (FLAGS_world_size > 1 && FLAGS_rank >= FLAGS_world_size)) {
    return Fail("--rank " + std::to_string(FLAGS_rank) + " is not in [0, --world-size " +
                std::to_string(FLAGS_world_size) + ")");
  }
  const int gpus = tgis::kernels::GpuCount();
  bool cuda = false;
  if (FLAGS_device == "cuda") {
    if (gpus == 0) return Fail("--device cuda: this build has no CUDA or no GPU is visible");
    cuda = true;
  } else if (FLAGS_device == "auto") {
    cuda = gpus > 0;
  } else if (FLAGS_device != "cpu") {
    return Fail("--device must be cpu, cuda or auto, not '" + FLAGS_device + "'");
  }
  if (FLAGS_dtype == "auto" || FLAGS_dtype.empty()) {
    FLAGS_dtype = cuda ? "bfloat16" : "float32";  // as TGIS: half precision on GPUs
  }
  tgis::kernels::DType dtype;
  if (!tgis::kernels::WeightDTypeFromName(FLAGS_dtype, &dtype)) {
    return Fail("--dtype must be float32, bfloat16 or float16, not '" + FLAGS_dtype + "'");
  }
  // One spelling from here on (the shard reports it in Info).
  FLAGS_dtype = dtype == tgis::kernels::DType::kF32    ? "float32"
                : dtype == tgis::kernels::DType::kBF16 ? "bfloat16"
                                                       : "float16";
  if (FLAGS_batch_safety_margin < 0 || FLAGS_batch_safety_margin > 100) {
    return Fail("--batch-safety-margin (BATCH_SAFETY_MARGIN) must be an integer from 0 to 100");
  }
  if (!(FLAGS_cuda_process_memory_fraction > 0.0 && FLAGS_cuda_process_memory_fraction <= 1.0)) {
    return Fail("cuda_process_memory_fraction must be in range 0 < x <= 1");
  }
  if (cuda) {
    // One GPU per shard, by rank, before anything touches CUDA.
    tgis::kernels::SelectGpu(FLAGS_rank % gpus);
    if (gflags::GetCommandLineFlagInfoOrDie("memory_fraction").is_default) {
      FLAGS_memory_fraction = 0.85;
    }
  }
  const tgis::server::ModelRegistry& registry = tgis::server::ModelRegistry::Get();
  auto config = registry.LoadConfig(model_dir);
  if (!config.ok()) return Fail(std::string(config.status().message()));
  auto weights = registry.OpenWeights(model_dir, *config);
  if (!weights.ok()) return Fail(std::string(weights.status().message()));
  auto quant = tgis::server::ReadQuantConfig(
      model_dir, *config,
      FLAGS_quantize.empty() ? std::nullopt : std::optional<std::string>(FLAGS_quantize));
  if (!quant.ok()) return Fail(std::string(quant.status().message()));
  (*weights)->set_quantization(*quant);
  std::shared_ptr<tgis::server::Communicator> comm;
  if (FLAGS_world_size > 1) {
    tgis::server::GlooOptions gloo;
    gloo.rank = FLAGS_rank;
    gloo.world_size = FLAGS_world_size;
    gloo.rendezvous_dir = FLAGS_rendezvous_dir.empty() ? tgis::server::DefaultRendezvousDir(
                                                             FLAGS_master_addr, FLAGS_master_port)
                                                       : FLAGS_rendezvous_dir;
    // The rendezvous is a directory on this machine, so the shards are local: their TCP devices
    // listen on MASTER_ADDR (loopback by default), or on GLOO_SOCKET_IFNAME when set.
    gloo.hostname = FLAGS_master_addr == "localhost" ? "127.0.0.1" : FLAGS_master_addr;
    if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface) {
      gloo.iface = iface;
    }
    gloo.timeout = std::chrono::seconds(FLAGS_collective_timeout);
    LOG(INFO) << "shard " << FLAGS_rank << "/" << FLAGS_world_size << ": joining the group in "
              << gloo.rendezvous_dir;
    auto connected = tgis::server::ConnectGloo(gloo);
    if (!connected.ok()) return Fail(std::string(connected.status().message()));
    comm = *connected;
    if (cuda) {
      auto nccl = tgis::server::ConnectNccl(comm);
      if (!nccl.ok()) return Fail(std::string(nccl.status().message()));
      comm = *nccl;
    }
    LOG(INFO) << "shard " << FLAGS_rank << "/" << FLAGS_world_size << ": connected"
              << (cuda ? " (NCCL)" : " (Gloo)");
  }
  auto model = registry.Build(*config, **weights, dtype, comm);
  if (!model.ok()) return Fail(std::string(model.status().message()));
  (*model)->MoveTo(cuda ? tgis::kernels::Device::kCuda : tgis::kernels::Device::kCpu);
  if (const size_t derived = tgis::kernels::CpuDerivedLayoutBytes(); derived > 0) {
    const size_t released = tgis::kernels::CpuReleasedCodeBytes();
    LOG(INFO) << "CPU kernels: 8- and 4-bit weights' codes interleaved 8 rows at a time take "
              << absl::StrFormat("%.1f", static_cast<double>(derived) / (1 << 20)) << " MiB; "
              << (released > 0
                      ? absl::StrFormat("their row-major copy and run constants (%.1f MiB) "
                                        "were let go",
                                        static_cast<double>(released) / (1 << 20))
                      : std::string("a second copy: the row-major codes stay for the AVX-512 "
                                    "kernels"));
  }
  (*weights)->FinishLoading();
  // The model holds what it serves from: the files' pages and the store go (views the model
  // kept read their pages back in; on a GPU none are left and the files are unmapped).
  (*weights)->ReleaseMappedPages();
  weights->reset();
  LOG(INFO) << "loaded " << config->model_type << " from " << model_dir << " (" << FLAGS_dtype
            << (FLAGS_world_size > 1 ? ", rank " + std::to_string(FLAGS_rank) + " of " +
                                           std::to_string(FLAGS_world_size)
                                     : std::string())
            << ")";

  tgis::server::ShardOptions opts;
  opts.dtype = FLAGS_dtype;
  opts.device = cuda ? "cuda" : "cpu";
  opts.rank = FLAGS_rank;
  opts.world_size = FLAGS_world_size;
  opts.block_size = FLAGS_block_size;
  opts.num_blocks = FLAGS_kv_cache_blocks;
  opts.memory_fraction = FLAGS_memory_fraction;
  opts.process_memory_fraction = FLAGS_cuda_process_memory_fraction;
  opts.batch_safety_margin = FLAGS_batch_safety_margin;
  opts.prefix_store_path = FLAGS_prefix_store_path;
  opts.prompt_cache_mb = FLAGS_prompt_cache_size_mb;
  opts.prefix_caching = FLAGS_prefix_caching;
  opts.cuda_graphs = FLAGS_cuda_graphs;
  if (FLAGS_decode_ahead == "auto") {
    opts.decode_ahead = cuda;
  } else if (FLAGS_decode_ahead == "true" || FLAGS_decode_ahead == "false") {
    opts.decode_ahead = FLAGS_decode_ahead == "true";
  } else {
    return Fail("--decode-ahead (DECODE_AHEAD) must be auto, true or false, not '" +
                FLAGS_decode_ahead + "'");
  }
  for (int r = 0; r < FLAGS_world_size; ++r) {
    opts.urls.push_back("unix://" + FLAGS_uds_path + "-" + std::to_string(r));
  }
  const std::string socket = FLAGS_uds_path + "-" + std::to_string(FLAGS_rank);
  std::error_code ec;
  std::filesystem::remove(socket, ec);
  tgis::server::ShardService service(std::move(*config), std::move(*model), opts);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix://" + socket, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.RegisterService(&service);
  g_server = builder.BuildAndStart();
  if (!g_server) return Fail("cannot listen on unix://" + socket);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  LOG(INFO) << "shard " << FLAGS_rank << " serving on unix://" << socket;
  g_server->Wait();
  std::filesystem::remove(socket, ec);
  return 0;
}

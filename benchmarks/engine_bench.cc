// CPU engine throughput on a model folder (see engine_bench.py, which makes a ~100M-parameter
// Llama-shaped checkpoint with random weights and compares with HF transformers):
//   engine_bench MODEL_DIR [--dtype float32|bfloat16|float16] [--quantize METHOD]
//                [--prompt 128] [--steps 32] [--batches 1,16] [--int8-activations true]
//                [--device cpu|cuda] [--cuda-graphs true] [--cuda-pdl false]
//                [--cuda-mma-gemv true] [--lora ADAPTER_DIR] [--isa avx2|...]
// Prints prefill and decode tokens/s per batch size, the memory bandwidth measured in the
// same run, and the fraction of it that batch-1 decode achieves (weights streamed per token),
// after one untimed warm-up prompt.
// --quantize is the shard's flag (bitsandbytes: int8 at load); a quantized checkpoint is
// detected without it. cpu_bench.py runs it beside llama.cpp and CTranslate2. --lora: every
// sequence takes that PEFT LoRA adapter (the shard's per-request LoRA; engine_bench.py
// --lora-rank makes one and compares with the base model and with PEFT). --isa: every Linear
// on that CPU code path (as kernels_bench's --isa), set before the weights' layouts are made.
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "server/engine.h"
#include "server/lora.h"
#include "server/model_config.h"
#include "server/model_registry.h"
#include "server/quantization.h"
#include "server/weights.h"

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

// Streaming read bandwidth over a buffer much larger than the caches, all cores.
double MeasureBandwidthGBs() {
  const size_t bytes = size_t{1} << 30;
  std::vector<float> buf(bytes / sizeof(float), 1.0f);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> sums(threads, 0);
    auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t n = buf.size() / threads;
        const float* p = buf.data() + t * n;
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
        for (size_t i = 0; i + 8 <= n; i += 8) {
          a0 += p[i];
          a1 += p[i + 1];
          a2 += p[i + 2];
          a3 += p[i + 3];
          a4 += p[i + 4];
          a5 += p[i + 5];
          a6 += p[i + 6];
          a7 += p[i + 7];
        }
        sums[t] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
      });
    }
    for (auto& th : pool) th.join();
    const double s = Seconds(t0);
    best = std::max(best, static_cast<double>(bytes) / s / 1e9);
    if (sums[0] < 0) std::cout << "";  // keep the loads
  }
  return best;
}

// This process's resident memory now, from /proc/self/status: "N MiB (anonymous A, file-backed
// F)", the file-backed part being checkpoint pages the kernel may drop; "?" where unreadable.
std::string Resident() {
  std::ifstream status("/proc/self/status");
  long rss = -1, anon = -1, file = -1;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stol(line.substr(6)) / 1024;
    if (line.rfind("RssAnon:", 0) == 0) anon = std::stol(line.substr(8)) / 1024;
    if (line.rfind("RssFile:", 0) == 0) file = std::stol(line.substr(8)) / 1024;
  }
  if (rss < 0) return "?";
  return std::to_string(rss) + " MiB (anonymous " + std::to_string(anon) + ", file-backed " +
         std::to_string(file) + ")";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--bandwidth-only") {
    std::cout << "memory_bandwidth_gbs " << MeasureBandwidthGBs() << "\n";
    return 0;
  }
  if (argc < 2 || argc % 2 != 0) {
    std::cerr << "usage: engine_bench MODEL_DIR [--dtype float32|bfloat16|float16] "
                 "[--quantize METHOD] [--prompt N] [--steps N] [--batches 1,16] "
                 "[--int8-activations true] [--device cpu|cuda] [--cuda-graphs true] "
                 "[--cuda-pdl false] [--cuda-mma-gemv true] [--lora ADAPTER_DIR] "
                 "[--isa scalar|avx2|avx512|vnni|bf16]\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::string dtype_name = "float32", quantize, batches_arg = "1,16", lora_dir;
  int prompt = 128, steps = 32;
  bool cuda = false, graphs = false, pdl = true, mma_gemv = false;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dtype") {
      dtype_name = v;
    } else if (k == "--quantize") {
      quantize = v;
    } else if (k == "--prompt") {
      prompt = std::atoi(v.c_str());
    } else if (k == "--steps") {
      steps = std::atoi(v.c_str());
    } else if (k == "--device") {  // cuda: the first GPU, as shard 0 (no roofline probe here)
      if (v != "cpu" && v != "cuda") {
        std::cerr << "--device: cpu or cuda\n";
        return 2;
      }
      cuda = v == "cuda";
    } else if (k == "--cuda-graphs") {  // the shard's --cuda-graphs
      graphs = v == "true";
    } else if (k == "--cuda-pdl") {  // false: kernels start in plain stream order
      pdl = v != "false";
    } else if (k == "--cuda-mma-gemv") {  // true: 16-bit decode GEMVs on tensor cores
      mma_gemv = v == "true";
    } else if (k == "--lora") {
      lora_dir = v;
    } else if (k == "--batches") {
      batches_arg = v;
    } else if (k == "--isa") {  // one CPU code path for every Linear, as kernels_bench's --isa
      namespace cpu = tgis::kernels::cpu;
      const cpu::Isa isa = cpu::IsaNamed(v);
      if (isa == cpu::Isa::kAuto || !cpu::IsaAvailable(isa)) {
        std::cerr << "--isa: " << v << " is not one of scalar avx2 avx512 vnni bf16 this CPU has\n";
        return 2;
      }
      cpu::SetIsaForTesting(isa);
    } else if (k == "--int8-activations") {  // the shard's --cpu-int8-activations
      if (v == "true" && !tgis::kernels::SetCpuInt8Activations(true)) {
        std::cerr << "--int8-activations: this CPU has no AVX-512 VNNI\n";
        return 2;
      }
    } else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  std::vector<int> batches;
  for (size_t pos = 0; pos < batches_arg.size();) {
    const size_t comma = std::min(batches_arg.find(',', pos), batches_arg.size());
    batches.push_back(std::atoi(batches_arg.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  tgis::kernels::DType dtype;
  if (!tgis::kernels::WeightDTypeFromName(dtype_name, &dtype)) {
    std::cerr << "unknown --dtype " << dtype_name << "\n";
    return 2;
  }
  if (cuda) {
    if (tgis::kernels::GpuCount() < 1) {
      std::cerr << "--device cuda: no GPU (or a build without CUDA)\n";
      return 1;
    }
    tgis::kernels::SelectGpu(0);
    std::cout << "programmatic dependent launch: "
              << (tgis::kernels::SetGpuProgrammaticLaunch(pdl) ? "on" : "off") << "\n";
    std::cout << "decode GEMVs of 16-bit weights: "
              << (tgis::kernels::SetGpuTensorCoreGemv(mma_gemv) ? "tensor cores" : "CUDA cores")
              << "\n";
  }
  const auto load_start = std::chrono::steady_clock::now();
  auto config = tgis::server::ModelRegistry::Get().LoadConfig(dir);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  auto weights = tgis::server::ModelRegistry::OpenWeights(dir, *config);
  if (!weights.ok()) {
    std::cerr << weights.status() << "\n";
    return 1;
  }
  auto quant = tgis::server::ReadQuantConfig(
      dir, *config, quantize.empty() ? std::nullopt : std::optional<std::string>(quantize));
  if (!quant.ok()) {
    std::cerr << quant.status() << "\n";
    return 1;
  }
  (*weights)->set_quantization(*quant);
  auto model = tgis::server::ModelRegistry::Get().Build(*config, **weights, dtype);
  if (!model.ok()) {
    std::cerr << model.status() << "\n";
    return 1;
  }
  // As the shard: on the CPU the kernels' layouts are made at load.
  (*model)->MoveTo(cuda ? tgis::kernels::Device::kCuda : tgis::kernels::Device::kCpu);
  std::cout << "resident after building the model: " << Resident() << "\n";
  (*weights)->ReleaseMappedPages();  // as the shard: the files' pages go, the store too
  weights->reset();
  std::cout << "load: "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count()
            << " s (config, weights, the model's layouts, as the shard)\n";
  std::cout << "resident after load: " << Resident() << "; CPU kernels' derived layouts "
            << tgis::kernels::CpuDerivedLayoutBytes() / (1 << 20) << " MiB, row-major codes let go "
            << tgis::kernels::CpuReleasedCodeBytes() / (1 << 20) << " MiB\n";
  const auto& spec = (*model)->spec();
  // Bytes of weights a batch-1 decode step streams: every linear layer plus the lm_head, in their
  // stored format (quantized: codes plus a scale and zero per row and group: f32 ones, or for
  // 4-bit codes the compact f16 scale and byte zero that GPTQ's and AWQ's f16 scales keep).
  const double wbytes = static_cast<double>(tgis::kernels::DTypeSize(dtype));
  const auto& q = *quant;
  auto linear_bytes = [&](double out, double in) {
    if (q.method == tgis::server::QuantMethod::kNone) return out * in * wbytes;
    if (q.method == tgis::server::QuantMethod::kInt8AtLoad) return out * in + out * 8;
    const double groups = q.group_size <= 0 ? 1 : std::ceil(in / q.group_size);
    return out * in * q.bits / 8 + out * groups * (q.bits == 4 ? 3 : 8);
  };
  const double h = spec.hidden, qd = spec.num_heads * spec.head_dim;
  auto mlp_bytes = [&](double inter) {
    return 2 * linear_bytes(inter, h) + linear_bytes(h, inter);
  };
  // A mixture of experts: one token reads its experts_per_token experts, the shared expert and
  // the router (f32 on the CPU, its shared gate row included), not the other experts.
  const double shared = static_cast<double>(spec.shared_expert_intermediate);
  const double mlp = spec.num_experts == 0
                         ? mlp_bytes(spec.intermediate)
                         : spec.experts_per_token * mlp_bytes(spec.intermediate) +
                               (shared > 0 ? mlp_bytes(shared) : 0.0) +
                               (spec.num_experts + (shared > 0 ? 1 : 0)) * h * 4.0;
  const double layer_bytes =
      linear_bytes(qd + 2 * spec.num_kv_heads * spec.head_dim, h) + linear_bytes(h, qd) + mlp;
  const double head_bytes =
      q.method == tgis::server::QuantMethod::kInt8AtLoad || q.lm_head_quantized.value_or(false)
          ? linear_bytes(spec.vocab, h)
          : spec.vocab * h * wbytes;
  const double streamed = layer_bytes * spec.num_layers + head_bytes;
  const int block = 16;
  const int blocks = 16 * ((prompt + steps) / block + 2);
  tgis::server::Engine engine(std::move(*model), config->eos_token_ids,
                              config->max_position_embeddings, blocks, block);
  if (graphs && !engine.EnableDecodeGraphs()) {
    std::cerr << "--cuda-graphs: this model or device runs eagerly\n";
    return 2;
  }
  std::shared_ptr<const tgis::server::LoraWeights> lora;
  if (!lora_dir.empty()) {
    auto adapter = tgis::server::ReadLoraAdapter(lora_dir, lora_dir);
    auto made =
        adapter.ok()
            ? engine.model().MakeLora(*adapter)
            : absl::StatusOr<std::shared_ptr<const tgis::server::LoraWeights>>(adapter.status());
    if (!made.ok()) {
      std::cerr << made.status() << "\n";
      return 1;
    }
    lora = *made;
    std::cout << "LoRA adapter " << lora_dir << ": rank " << adapter->rank << ", "
              << lora->bytes() / 1e6 << " MB, on every sequence\n";
  }
  std::mt19937 rng(1);
  std::cout << "model: " << config->model_type << " layers " << spec.num_layers << " hidden "
            << spec.hidden << " vocab " << spec.vocab << " dtype " << dtype_name
            << (quantize.empty() ? "" : " quantize " + quantize) << " streamed/token "
            << streamed / 1e6 << " MB\n";
  // On a GPU the roofline is the device's copy bandwidth, which gpu_bench.py measures.
  const double bw = cuda ? 0.0 : MeasureBandwidthGBs();
  std::cout << "memory_bandwidth_gbs " << bw << "\n";
  {
    // One untimed prompt and step first, as llama-bench (its warm-up run) and cpu_bench.py's
    // CTranslate2 timing (best of three) have: the first pass pays one-time costs a server
    // pays once (page faults on f32 weights read in place from the mapped file, the KV
    // cache's and the kernels' scratch pages: measured 134 against 187 tok/s f32 prefill).
    tgis::server::NewSequence s;
    s.id = 0;
    s.max_new_tokens = 2;
    s.lora = lora;
    for (int t = 0; t < prompt; ++t) s.input_ids.push_back(static_cast<int32_t>(t % spec.vocab));
    std::vector<tgis::server::NewSequence> warm;
    warm.push_back(std::move(s));
    std::vector<tgis::server::StepOutput> out;
    std::vector<tgis::server::SequenceError> errors;
    engine.Prefill(std::move(warm), &out, &errors);
    if (errors.empty()) engine.Decode({0}, &out, &errors);
    if (!errors.empty()) {
      std::cerr << errors[0].status << "\n";
      return 1;
    }
    engine.ReleaseAll();
  }
  for (int batch : batches) {
    std::vector<tgis::server::NewSequence> seqs;
    std::vector<uint64_t> ids;
    for (int b = 0; b < batch; ++b) {
      tgis::server::NewSequence s;
      s.id = b;
      s.max_new_tokens = steps;
      s.lora = lora;
      for (int t = 0; t < prompt; ++t)
        s.input_ids.push_back(static_cast<int32_t>(rng() % spec.vocab));
      seqs.push_back(std::move(s));
      ids.push_back(b);
    }
    std::vector<tgis::server::StepOutput> out;
    std::vector<tgis::server::SequenceError> errors;
    auto t0 = Clock::now();
    engine.Prefill(std::move(seqs), &out, &errors);
    const double prefill_s = Seconds(t0);
    if (!errors.empty()) {
      std::cerr << errors[0].status << "\n";
      return 1;
    }
    t0 = Clock::now();
    for (int s = 0; s < steps; ++s) {
      out.clear();
      engine.Decode(ids, &out, &errors);
    }
    const double decode_s = Seconds(t0);
    const double step_s = decode_s / steps;
    std::cout << "batch " << batch << ": prefill " << batch * prompt / prefill_s
              << " tok/s, decode " << batch * steps / decode_s << " tok/s (" << step_s * 1e3
              << " ms/step)";
    if (batch == 1 && bw > 0) {
      std::cout << ", decode bandwidth " << streamed / step_s / 1e9
                << " GB/s = " << 100.0 * streamed / step_s / 1e9 / bw << "% of measured";
    }
    std::cout << "\n";
    for (uint64_t id : ids) engine.Release(id);
  }
  return 0;
}

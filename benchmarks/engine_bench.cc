// CPU engine throughput on a model folder (see engine_bench.py, which makes a ~100M-parameter
// Llama-shaped checkpoint with random weights and compares with HF transformers):
//   engine_bench MODEL_DIR [--dtype float32|bfloat16] [--prompt 128] [--steps 32]
// Prints prefill and decode tokens/s at batch 1 and 16, the memory bandwidth measured in the
// same run, and the fraction of it that batch-1 decode achieves (weights streamed per token).
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/engine.h"
#include "server/model_config.h"
#include "server/model_registry.h"
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr
        << "usage: engine_bench MODEL_DIR [--dtype float32|bfloat16] [--prompt N] [--steps N]\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::string dtype_name = "float32";
  int prompt = 128, steps = 32;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--dtype") dtype_name = argv[i + 1];
    if (k == "--prompt") prompt = std::atoi(argv[i + 1]);
    if (k == "--steps") steps = std::atoi(argv[i + 1]);
  }
  const auto dtype =
      dtype_name == "bfloat16" ? tgis::kernels::DType::kBF16 : tgis::kernels::DType::kF32;
  auto config = tgis::server::ModelConfig::Load(dir);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  auto weights = tgis::server::WeightStore::Open(dir);
  if (!weights.ok()) {
    std::cerr << weights.status() << "\n";
    return 1;
  }
  auto model = tgis::server::ModelRegistry::Get().Build(*config, **weights, dtype);
  if (!model.ok()) {
    std::cerr << model.status() << "\n";
    return 1;
  }
  const auto& spec = (*model)->spec();
  // Bytes of weights a decode step streams: every linear layer plus the lm_head.
  const double wbytes = static_cast<double>(tgis::kernels::DTypeSize(dtype));
  const double layer_params = static_cast<double>(
      (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * spec.hidden +
      spec.hidden * spec.num_heads * spec.head_dim + 3 * spec.hidden * spec.intermediate);
  const double streamed = (layer_params * spec.num_layers + spec.vocab * spec.hidden) * wbytes;
  const int block = 16;
  const int blocks = 16 * ((prompt + steps) / block + 2);
  tgis::server::Engine engine(std::move(*model), config->eos_token_ids,
                              config->max_position_embeddings, blocks, block);
  std::mt19937 rng(1);
  std::cout << "model: " << config->model_type << " layers " << spec.num_layers << " hidden "
            << spec.hidden << " vocab " << spec.vocab << " dtype " << dtype_name
            << " streamed/token " << streamed / 1e6 << " MB\n";
  const double bw = MeasureBandwidthGBs();
  std::cout << "memory_bandwidth_gbs " << bw << "\n";
  for (int batch : {1, 16}) {
    std::vector<tgis::server::NewSequence> seqs;
    std::vector<uint64_t> ids;
    for (int b = 0; b < batch; ++b) {
      tgis::server::NewSequence s;
      s.id = b;
      s.max_new_tokens = steps;
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
    if (batch == 1) {
      std::cout << ", decode bandwidth " << streamed / step_s / 1e9
                << " GB/s = " << 100.0 * streamed / step_s / 1e9 / bw << "% of measured";
    }
    std::cout << "\n";
    for (uint64_t id : ids) engine.Release(id);
  }
  return 0;
}

// Mamba-2's selective scan (kernels::SelectiveScan) at Granite 4.0-H's sizes: one layer's
// mixer between its projections, for a prompt of T tokens (one sequence) and for decode steps
// of B sequences (one token each), on the CPU or on CUDA (the activations in --dtype there, the
// states f32). Prints milliseconds per call and per token, so that the scan's share of a step
// can be set against the layer's matmuls.
//   ssm_bench [--device cpu|cuda] [--dtype f32|bf16] [--heads 48] [--head-dim 64] [--groups 1]
//             [--state 128] [--kernel 4] [--prefill 512] [--batch 1,16] [--reps 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace {

using tgis::kernels::DType;
using tgis::kernels::Tensor;

std::vector<int64_t> List(const char* text) {
  std::vector<int64_t> out;
  for (const char* p = text; *p;) {
    out.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return out;
}

using tgis::kernels::Device;

Device g_device = Device::kCpu;

Tensor OnDevice(const Tensor& t) { return g_device == Device::kCpu ? t : t.ToDevice(g_device); }

// f32 values N(0, scale), in `dtype`, on the chosen device.
Tensor Random(const tgis::kernels::Shape& shape, float scale, uint32_t seed,
              DType dtype = DType::kF32) {
  Tensor t = Tensor::Zeros(shape, DType::kF32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(rng);
  return OnDevice(dtype == DType::kF32 ? t : t.To(dtype));
}

// Waits for the device's queued work (a small copy back).
void Finish(const Tensor& t) {
  if (t.device() != Device::kCpu) (void)t.Rows(0, 1).ToDevice(Device::kCpu);
}

}  // namespace

int main(int argc, char** argv) {
  tgis::kernels::SsmConfig cfg{48, 64, 1, 128, 4};
  std::vector<int64_t> prefill = {512}, batches = {1, 16};
  int reps = 5;
  DType act = DType::kF32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--device") g_device = std::string(v) == "cuda" ? Device::kCuda : Device::kCpu;
    if (a == "--dtype") act = std::string(v) == "bf16" ? DType::kBF16 : DType::kF32;
    if (a == "--heads") cfg.heads = std::atoll(v);
    if (a == "--head-dim") cfg.head_dim = std::atoll(v);
    if (a == "--groups") cfg.groups = std::atoll(v);
    if (a == "--state") cfg.state_size = std::atoll(v);
    if (a == "--kernel") cfg.conv_kernel = std::atoll(v);
    if (a == "--prefill") prefill = List(v);
    if (a == "--batch") batches = List(v);
    if (a == "--reps") reps = std::atoi(v);
  }
  if (g_device == Device::kCuda) {
    if (tgis::kernels::GpuCount() == 0) {
      std::fprintf(stderr, "--device cuda: no GPU (or a build without CUDA)\n");
      return 2;
    }
    tgis::kernels::SelectGpu(0);
  } else {
    act = DType::kF32;  // the CPU's activations
  }
  const int64_t inner = cfg.heads * cfg.head_dim;
  const int64_t channels = inner + 2 * cfg.groups * cfg.state_size;
  const int64_t width = inner + channels + cfg.heads;
  const Tensor conv_w = Random({channels, cfg.conv_kernel}, 0.3f, 1);
  const Tensor conv_b = Random({channels}, 0.1f, 2);
  const Tensor dt_bias = Random({cfg.heads}, 0.1f, 3);
  const Tensor a_log = Random({cfg.heads}, 0.1f, 4);
  const Tensor d = Random({cfg.heads}, 1.0f, 5);
  std::printf("%s %s: heads %lld x %lld, groups %lld, state %lld, kernel %lld (one layer)\n",
              g_device == Device::kCpu ? "cpu" : "cuda", tgis::kernels::DTypeName(act),
              static_cast<long long>(cfg.heads), static_cast<long long>(cfg.head_dim),
              static_cast<long long>(cfg.groups), static_cast<long long>(cfg.state_size),
              static_cast<long long>(cfg.conv_kernel));
  auto run = [&](int64_t seqs, int64_t tokens_each) {
    const int64_t t = seqs * tokens_each;
    const Tensor proj = Random({t, width}, 1.0f, 6, act);
    Tensor out = OnDevice(Tensor::Zeros({t, 2 * inner}, act));
    std::vector<Tensor> conv, ssm;
    std::vector<int32_t> starts = {0};
    for (int64_t s = 0; s < seqs; ++s) {
      conv.push_back(OnDevice(Tensor::Zeros({channels, cfg.conv_kernel - 1}, DType::kF32)));
      ssm.push_back(
          OnDevice(Tensor::Zeros({cfg.heads, cfg.head_dim, cfg.state_size}, DType::kF32)));
      starts.push_back(static_cast<int32_t>((s + 1) * tokens_each));
    }
    std::vector<Tensor*> conv_p, ssm_p;
    for (int64_t s = 0; s < seqs; ++s) {
      conv_p.push_back(&conv[s]);
      ssm_p.push_back(&ssm[s]);
    }
    const std::vector<uint8_t> fresh(static_cast<size_t>(seqs), 0);
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      tgis::kernels::SelectiveScan(cfg, proj, conv_w, conv_b, dt_bias, a_log, d, starts, conv_p,
                                   ssm_p, fresh, &out);
      Finish(out);
      best = std::min(
          best,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  for (int64_t t : prefill) {
    const double ms = run(1, t);
    std::printf("prefill %5lld tokens: %9.3f ms, %7.4f ms/token\n", static_cast<long long>(t), ms,
                ms / static_cast<double>(t));
  }
  for (int64_t b : batches) {
    const double ms = run(b, 1);
    std::printf("decode batch %4lld: %9.3f ms, %7.4f ms/token\n", static_cast<long long>(b), ms,
                ms / static_cast<double>(b));
  }
  return 0;
}

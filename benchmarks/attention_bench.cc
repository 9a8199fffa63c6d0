// Paged attention (the PagedAttention op) at serving shapes, on the CPU or a GPU: a prompt's
// prefill (T tokens, causal, one sequence: the tiled kernels, on tensor cores for 16-bit
// activations on CUDA) and decode steps of B sequences at context C (the grouped kernel on
// CUDA). Prints milliseconds per call; for prefill the attention FLOP/s (two matmuls over the
// causal half), for decode the GB/s of keys and values read and their fraction of the device's
// copy bandwidth measured in the same run (read + write of 1 GiB).
//   attention_bench [--device cpu|cuda] [--dtype bf16|f16|f32] [--heads 32] [--kv-heads 8]
//                   [--head-dim 128] [--prefill 512,2048] [--batch 1,16] [--context 1024,4096]
//                   [--reps 5] [--partition-keys N,...]  (CUDA: the grouped decode kernel's
//                                                     keys per partition, each decode shape at
//                                                     each; default its own)
//                   [--compare-staging 1]  (CUDA: each decode shape also with the grouped
//                                           kernel's rows loaded directly where it would stage
//                                           them in shared memory: the same bits, other speed)
//                   [--cold 1]  (CPU: before each timed call, 128 MiB are read so that the
//                                keys and values come from memory, as in a decode step where
//                                the weights stream between layers; only the call is timed)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"
#ifdef TGIS_WITH_CUDA
#include "kernels/cuda_ops.h"
#endif

namespace {

using tgis::kernels::AttentionBatch;
using tgis::kernels::Device;
using tgis::kernels::DType;
using tgis::kernels::KvCacheLayer;
using tgis::kernels::Tensor;
using Clock = std::chrono::steady_clock;

struct Options {
  Device device = Device::kCpu;
  DType dtype = DType::kF32;
  int64_t heads = 32, kv_heads = 8, head_dim = 128, reps = 5;
  bool cold = false;  // CPU: evict the caches before each timed call
  std::vector<int64_t> prefill = {512, 2048}, batch = {1, 16}, context = {1024, 4096};
};

std::vector<int64_t> List(const std::string& s) {
  std::vector<int64_t> out;
  for (size_t pos = 0; pos < s.size();) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    out.push_back(std::atoll(s.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  return out;
}

// Values in [-1, 1) from a hash of the index (gigabytes of cache fill in seconds).
Tensor Random(int64_t n, const tgis::kernels::Shape& shape, const Options& o, DType dtype,
              uint32_t seed) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t h = (static_cast<uint32_t>(i) ^ (seed * 0x9e3779b9u)) * 2654435761u;
    v[i] = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
  }
  Tensor t = Tensor::FromVector(v, shape).To(dtype);
  return o.device == Device::kCpu ? t : t.ToDevice(o.device);
}

Tensor Index(const std::vector<int32_t>& v, const Options& o) {
  Tensor t = Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
  return o.device == Device::kCpu ? t : t.ToDevice(o.device);
}

// Waits for the device's queued work (a small copy back).
void Finish(const Tensor& t) {
  if (t.device() != Device::kCpu) (void)t.Rows(0, 1).ToDevice(Device::kCpu);
}

// Adds two 64 MiB tensors (4x a large L3) with the op's own threads, so that no core's cache
// holds the attention's rows and the workers are awake, as between a decode step's layers.
void EvictCaches() {
  static Tensor a = Tensor::Zeros({int64_t{16} << 20}, DType::kF32);
  static const Tensor b = Tensor::Zeros({int64_t{16} << 20}, DType::kF32);
  tgis::kernels::AddInPlace(&a, b);
}

// Seconds per call of attention over `seqs` sequences of `q_len` query rows at context `ctx`.
double TimeAttention(const Options& o, int64_t seqs, int64_t q_len, int64_t ctx) {
  constexpr int kBlock = 16;
  const int64_t blocks_per_seq = (ctx + kBlock - 1) / kBlock, d = o.head_dim;
  const int64_t blocks = seqs * blocks_per_seq;
  KvCacheLayer cache;
  cache.k =
      Random(blocks * kBlock * o.kv_heads * d, {blocks, kBlock, o.kv_heads, d}, o, o.dtype, 1);
  cache.v =
      Random(blocks * kBlock * o.kv_heads * d, {blocks, kBlock, o.kv_heads, d}, o, o.dtype, 2);
  std::vector<int32_t> query_start = {0}, lens, tables;
  for (int64_t s = 0; s < seqs; ++s) {
    query_start.push_back(static_cast<int32_t>((s + 1) * q_len));
    lens.push_back(static_cast<int32_t>(ctx));
    for (int64_t b = 0; b < blocks_per_seq; ++b)
      tables.push_back(static_cast<int32_t>(s * blocks_per_seq + b));
  }
  AttentionBatch batch;
  batch.query_start = Index(query_start, o);
  batch.context_lens = Index(lens, o);
  batch.block_tables = Index(tables, o).Reshape({seqs, blocks_per_seq});
  batch.block_size = kBlock;
  batch.max_context_len = ctx;
  batch.min_query_len = batch.max_query_len = q_len;
  // Activations are f32 on the CPU (its cache may hold 16-bit values), the dtype on CUDA.
  const DType act = o.device == Device::kCpu ? DType::kF32 : o.dtype;
  const Tensor q = Random(seqs * q_len * o.heads * d, {seqs * q_len, o.heads, d}, o, act, 3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Tensor out;
  tgis::kernels::PagedAttention(q, cache, batch, scale, 0, nullptr, &out);  // warm-up
  Finish(out);
  if (o.cold && o.device == Device::kCpu) {
    double seconds = 0;
    for (int64_t r = 0; r < o.reps; ++r) {
      EvictCaches();
      const auto t0 = Clock::now();
      tgis::kernels::PagedAttention(q, cache, batch, scale, 0, nullptr, &out);
      seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    return seconds / static_cast<double>(o.reps);
  }
  const auto t0 = Clock::now();
  for (int64_t r = 0; r < o.reps; ++r) {
    tgis::kernels::PagedAttention(q, cache, batch, scale, 0, nullptr, &out);
  }
  Finish(out);
  return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(o.reps);
}

// GB/s of a 1 GiB device-to-device (or memory-to-memory) copy, read plus write.
double CopyBandwidth(const Options& o) {
  const size_t bytes = size_t{1} << 30;
  if (o.device == Device::kCpu) {
    std::vector<char> a(bytes, 1), b(bytes, 0);
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    volatile char sink = b[bytes / 2];  // the copy is used
    (void)sink;
    return 2.0 * static_cast<double>(bytes) / s / 1e9;
  }
#ifdef TGIS_WITH_CUDA
  const Tensor a = Tensor::Zeros({static_cast<int64_t>(bytes)}, DType::kU8).ToDevice(o.device);
  Tensor b = Tensor::Zeros({static_cast<int64_t>(bytes)}, DType::kU8).ToDevice(o.device);
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = Clock::now();
    tgis::kernels::cuda::Copy(b.raw(), o.device, a.raw(), o.device, bytes);
    Finish(b);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(bytes) / s / 1e9);
  }
  return best;
#else
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  [[maybe_unused]] bool compare_staging = false;         // CUDA builds
  [[maybe_unused]] std::vector<int64_t> partition_keys;  // CUDA: empty, the kernel's own
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--device") {
      o.device = v == "cuda" ? Device::kCuda : Device::kCpu;
    } else if (k == "--dtype") {
      o.dtype = v == "bf16" ? DType::kBF16 : v == "f16" ? DType::kF16 : DType::kF32;
    } else if (k == "--heads") {
      o.heads = std::atoll(v.c_str());
    } else if (k == "--kv-heads") {
      o.kv_heads = std::atoll(v.c_str());
    } else if (k == "--head-dim") {
      o.head_dim = std::atoll(v.c_str());
    } else if (k == "--prefill") {
      o.prefill = List(v);
    } else if (k == "--batch") {
      o.batch = List(v);
    } else if (k == "--context") {
      o.context = List(v);
    } else if (k == "--partition-keys") {
#ifdef TGIS_WITH_CUDA
      partition_keys = List(v);
#else
      std::fprintf(stderr, "--partition-keys: this build has no CUDA\n");
      return 2;
#endif
    } else if (k == "--compare-staging") {
#ifdef TGIS_WITH_CUDA
      compare_staging = v == "1";
#else
      std::fprintf(stderr, "--compare-staging: this build has no CUDA\n");
      return 2;
#endif
    } else if (k == "--cold") {
      o.cold = v == "1";
    } else if (k == "--reps") {
      o.reps = std::max<int64_t>(1, std::atoll(v.c_str()));
    } else {
      std::fprintf(stderr,
                   "usage: attention_bench [--device cpu|cuda] [--dtype bf16|f16|f32] [--heads N]"
                   " [--kv-heads N] [--head-dim N] [--prefill T,...] [--batch B,...]"
                   " [--context C,...] [--reps N] [--partition-keys N,...] [--compare-staging 1]"
                   " [--cold 1]\n");
      return 2;
    }
  }
  std::printf("attention_bench: %s %s, %lld heads, %lld KV heads, head_dim %lld\n",
              o.device == Device::kCpu ? "cpu" : "cuda", tgis::kernels::DTypeName(o.dtype),
              static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
              static_cast<long long>(o.head_dim));
  for (int64_t t : o.prefill) {
    const double s = TimeAttention(o, 1, t, t);
    // Q.K^T and P.V over the causal half: 2 x 2 x (T (T + 1) / 2) x d per head.
    const double flops = 4.0 * static_cast<double>(t) * static_cast<double>(t + 1) / 2.0 *
                         static_cast<double>(o.head_dim) * static_cast<double>(o.heads);
    std::printf("prefill %6lld tokens: %9.3f ms  %8.2f TFLOP/s\n", static_cast<long long>(t),
                s * 1e3, flops / s / 1e12);
  }
  const double copy = CopyBandwidth(o);
  std::printf("copy bandwidth (read + write): %.1f GB/s\n", copy);
  const double elem = static_cast<double>(tgis::kernels::DTypeSize(o.dtype));
  for (int64_t b : o.batch) {
    for (int64_t c : o.context) {
      const double bytes = 2.0 * static_cast<double>(b * c * o.kv_heads * o.head_dim) * elem;
      const std::vector<int64_t> parts =
          partition_keys.empty() ? std::vector<int64_t>{0} : partition_keys;
      for (int64_t keys : parts) {
#ifdef TGIS_WITH_CUDA
        if (keys > 0)
          tgis::kernels::cuda::SetGroupedPartitionKeysForTesting(static_cast<int>(keys));
#endif
        const double s = TimeAttention(o, b, 1, c);
        std::printf("decode batch %4lld context %6lld: %9.3f ms  %8.1f GB/s  %5.1f%% of copy",
                    static_cast<long long>(b), static_cast<long long>(c), s * 1e3, bytes / s / 1e9,
                    copy > 0 ? 100.0 * bytes / s / 1e9 / copy : 0.0);
        if (keys > 0) std::printf("  (%lld keys a partition)", static_cast<long long>(keys));
        std::printf("\n");
#ifdef TGIS_WITH_CUDA
        if (compare_staging) {
          tgis::kernels::cuda::SetGroupedStagingForTesting(false);
          const double direct = TimeAttention(o, b, 1, c);
          tgis::kernels::cuda::SetGroupedStagingForTesting(true);
          std::printf("    direct loads where it stages: %9.3f ms  %5.1f%% of copy\n", direct * 1e3,
                      copy > 0 ? 100.0 * bytes / direct / 1e9 / copy : 0.0);
        }
#endif
      }
    }
  }
  return 0;
}

// Kernel micro benchmarks: the machine's streaming-read bandwidth, and Linear (the decode hot
// path) as GB/s of weights streamed (quantized: codes, scales and zeros) and as a fraction of
// that bandwidth.
//
//   kernels_bench [--quick] [--hot] [--t=N] [--shape=OUTxIN] [--int8-activations]
//                 [--isa=scalar|avx2|avx512|vnni|bf16] [format ...]
// formats: bf16 f16 f32 int8 gptq8 gptq4 (g128) gptq4g32 fp8 gptq4g32-f32 (f32 run constants)
// nf4 (bitsandbytes' table codes, blocks of 64) mxfp4 (table codes, blocks of 32)
//
// --hot adds a 1024x2048 weight read from cache (one copy, called repeatedly): the kernels'
// compute ceiling, without DRAM in the way. --shape times that weight shape only: with --hot and
// TGIS_CPU_THREADS=1, a weight that fits one core's L2 (256x2048 of 8-bit codes) gives the
// kernel's own instruction ceiling, where 1024x2048 streams from L3.
//
// Weights are cycled over enough copies (>= 1 GiB in all) that no call finds them in cache.
// T = 1 and 16 (the default Ts) take the streaming kernel, T = 64 the prefill GEMM (ours with
// AVX-512, bf16 weights' vdpbf16ps one with AVX512_BF16, else OpenBLAS; for 8- and 4-bit codes
// with --int8-activations, the int8 GEMM); --t=N times one T of any size.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "kernels/quantized.h"
#include "kernels/tensor.h"

namespace {

using tgis::kernels::DType;
using tgis::kernels::Tensor;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Sums of n (a multiple of 16) words.
__attribute__((target("avx2"), noinline)) uint64_t SumAvx2(const uint64_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

__attribute__((noinline)) uint64_t SumScalar(const uint64_t* p, size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

// Best-of-5 streaming read of a 1 GiB buffer on the kernels' thread pool, in GB/s (1e9 B/s).
double MeasureBandwidth(size_t bytes) {
  const size_t n = bytes / sizeof(uint64_t);
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(64, bytes));
  auto& pool = tgis::kernels::cpu::ThreadPool::Global();
  const int64_t tasks = pool.size();
  // Touch the pages from the threads that will read them.
  pool.Run(tasks, [&](int64_t t) {
    const size_t b = n * t / tasks, e = n * (t + 1) / tasks;
    for (size_t i = b; i < e; ++i) buf[i] = i;
  });
  const bool avx2 = __builtin_cpu_supports("avx2");
  double best = 0;
  std::atomic<uint64_t> sink{0};
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    // 1 MiB pieces handed out dynamically, as Linear hands out its row blocks.
    const size_t piece = (size_t{1} << 20) / sizeof(uint64_t);
    pool.Run(static_cast<int64_t>(n / piece), [&](int64_t i) {
      const uint64_t* p = buf + i * piece;
      sink += avx2 ? SumAvx2(p, piece) : SumScalar(p, piece);
    });
    best = std::max(best, bytes / Seconds(t0, Clock::now()) / 1e9);
  }
  if (sink.load() == 42) std::printf(" ");
  std::free(buf);
  return best;
}

struct LinearResult {
  double seconds;  // per call, best of the timed runs
  double bytes;    // what one call streams: the weight, or codes, scales and zeros
};

// How the benchmarked weight is stored: a float dtype or one of the quantized layouts.
struct Format {
  const char* name;
  DType dtype;     // the float dtype (quantized: unused)
  int quant_bits;  // 0: dense; 8 or 4: integer codes
  int64_t group;   // quantized: input columns per scale (-1: the whole row)
  bool fp8;
  double bytes_per_weight;
  // Quantized scales that are f16 values (as GPTQ and AWQ write them), which 4-bit weights
  // keep compact (QuantizedWeight::compact); false: f32 values, kept as f32.
  bool f16_scales = true;
  bool codebook = false;  // 4-bit codes index a table of 16 values (nf4's, MXFP4's E2M1)
};

// A weight of `f`'s layout with small deterministic values (speed does not depend on them).
Tensor MakeWeight(const Format& f, int64_t out_f, int64_t in, int c) {
  using tgis::kernels::QuantizedWeight;
  if (f.quant_bits == 0) {
    Tensor w = Tensor::Empty({out_f, in}, f.dtype);
    if (f.dtype == DType::kF32) {
      for (int64_t i = 0; i < out_f * in; ++i) w.data<float>()[i] = ((i * 7 + c) % 13) * 0.01f;
    } else {
      const uint16_t v = f.dtype == DType::kBF16 ? tgis::kernels::F32ToBf16(0.01f)
                                                 : tgis::kernels::F32ToF16(0.01f);
      for (int64_t i = 0; i < out_f * in; ++i) w.data<uint16_t>()[i] = v;
    }
    return w;
  }
  std::vector<uint8_t> codes(out_f * in);
  for (int64_t i = 0; i < out_f * in; ++i)
    codes[i] = static_cast<uint8_t>(((i * 7 + c) % 13) & ((1 << f.quant_bits) - 1));
  const int64_t group = f.group < 0 ? in : f.group;
  const int64_t groups = (in + group - 1) / group;
  std::vector<int32_t> group_of(in);
  for (int64_t k = 0; k < in; ++k) group_of[k] = static_cast<int32_t>(k / group);
  const float scale =
      f.f16_scales ? tgis::kernels::F16ToF32(tgis::kernels::F32ToF16(0.01f)) : 0.01f;
  std::vector<float> scales(out_f * groups, scale), zeros(out_f * groups, 1 << (f.quant_bits - 1));
  std::vector<float> table(16);
  for (int i = 0; i < 16; ++i) table[i] = (i - 7) / 8.f;
  QuantizedWeight q =
      f.fp8 ? tgis::kernels::BuildFp8Rows(out_f, in, codes, std::vector<float>(out_f, 0.01f))
      : f.codebook
          ? tgis::kernels::BuildCodebook4(out_f, in, codes, group_of, groups, scales, table)
          : tgis::kernels::BuildQuantized(f.quant_bits, out_f, in, codes, group_of, groups, scales,
                                          zeros);
  return Tensor::Quantized(std::make_shared<const QuantizedWeight>(std::move(q)));
}

LinearResult TimeLinear(int64_t out_f, int64_t in, const Format& f, int64_t t_count, bool quick,
                        bool hot) {
  const size_t weight_bytes = static_cast<size_t>(out_f * in * f.bytes_per_weight);
  const int copies = hot ? 1
                         : static_cast<int>(std::max<size_t>(
                               2, ((quick ? 256u : 1024u) << 20) / weight_bytes + 1));
  std::vector<Tensor> ws;
  for (int c = 0; c < copies; ++c) ws.push_back(MakeWeight(f, out_f, in, c));
  Tensor x = Tensor::Empty({t_count, in}, DType::kF32);
  for (int64_t i = 0; i < t_count * in; ++i) x.data<float>()[i] = (i % 17) * 0.1f;
  Tensor out = Tensor::Empty({t_count, out_f}, DType::kF32);
  for (int c = 0; c < copies; ++c) tgis::kernels::Linear(x, ws[c], nullptr, &out);  // warm up
  const int calls = hot ? 200 : quick ? copies : 3 * copies;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) tgis::kernels::Linear(x, ws[i % copies], nullptr, &out);
    best = std::min(best, Seconds(t0, Clock::now()) / calls);
  }
  const tgis::kernels::QuantizedWeight* q = ws[0].quantized();
  const double bytes =
      q == nullptr
          ? static_cast<double>(ws[0].nbytes())
          : static_cast<double>(q->codes.nbytes() + q->scales.nbytes() + q->zeros.nbytes());
  return {best, bytes};
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, hot = false;
  int64_t only_t = 0;                   // --t=N: only that many x rows
  int64_t shape_out = 0, shape_in = 0;  // --shape=OUTxIN: only that weight shape
  std::vector<std::string> wanted;      // formats named on the command line, else all of them
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--hot") == 0) {
      hot = true;
    } else if (std::strcmp(argv[i], "--int8-activations") == 0) {
      if (!tgis::kernels::SetCpuInt8Activations(true)) {
        std::fprintf(stderr, "--int8-activations: this CPU has no AVX2\n");
        return 2;
      }
    } else if (std::strncmp(argv[i], "--shape=", 8) == 0) {
      if (std::sscanf(argv[i] + 8, "%" SCNd64 "x%" SCNd64, &shape_out, &shape_in) != 2 ||
          shape_out <= 0 || shape_in <= 0 || shape_in % 16 != 0) {
        std::fprintf(stderr, "--shape: want OUTxIN, IN a multiple of 16, not %s\n", argv[i] + 8);
        return 2;
      }
    } else if (std::strncmp(argv[i], "--t=", 4) == 0) {
      only_t = std::atoll(argv[i] + 4);
    } else if (std::strncmp(argv[i], "--isa=", 6) == 0) {
      namespace cpu = tgis::kernels::cpu;
      const std::string name = argv[i] + 6;
      const cpu::Isa isa = cpu::IsaNamed(name);
      if (isa == cpu::Isa::kAuto || !cpu::IsaAvailable(isa)) {
        std::fprintf(stderr, "--isa: %s is not one of scalar avx2 avx512 vnni bf16 this CPU has\n",
                     name.c_str());
        return 2;
      }
      cpu::SetIsaForTesting(isa);
    } else {
      wanted.push_back(argv[i]);
    }
  }
  const int threads = tgis::kernels::cpu::ThreadPool::Global().size();
  std::printf("threads: %d  linear isa: %s\n", threads, tgis::kernels::cpu::ActiveIsaName());
  const double bw = MeasureBandwidth(size_t{1} << 30);
  std::printf("memory bandwidth (streaming read, 1 GiB, best of 5): %.1f GB/s\n\n", bw);

  std::printf("%-8s %-14s %4s %10s %10s %8s %10s\n", "format", "weight", "T", "ms/call", "GB/s",
              "of bw", "GFLOP/s");
  struct Shape {
    int64_t out_f, in;
  };
  const Format formats[] = {
      {"bf16", DType::kBF16, 0, 0, false, 2},
      {"f16", DType::kF16, 0, 0, false, 2},
      {"f32", DType::kF32, 0, 0, false, 4},
      {"int8", DType::kF32, 8, -1, false, 1},
      {"gptq8", DType::kF32, 8, 128, false, 1},
      {"gptq4", DType::kF32, 4, 128, false, 0.5},
      {"gptq4g32", DType::kF32, 4, 32, false, 0.5},
      {"fp8", DType::kF32, 8, -1, true, 1},
      // 4-bit g32 whose scales are not f16 values: f32 run constants, 8 bytes a run.
      {"gptq4g32-f32", DType::kF32, 4, 32, false, 0.5, false},
      // bitsandbytes nf4 (codes that index a table) in blocks of 64, f32 absmax scales.
      {"nf4", DType::kF32, 4, 64, false, 0.5, false, true},
      // MXFP4 (gpt-oss's experts): table codes in blocks of 32, power-of-two f32 scales.
      {"mxfp4", DType::kF32, 4, 32, false, 0.5, false, true},
  };
  for (const Format& f : formats) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), f.name) == wanted.end())
      continue;
    // Llama-2-7B's q/o and gate/up shapes, and TinyLlama's gate_up (short rows) and down.
    std::vector<Shape> shapes = {Shape{4096, 4096}, Shape{11008, 4096}, Shape{11264, 2048},
                                 Shape{2048, 5632}};
    if (hot) shapes = {Shape{1024, 2048}};
    if (shape_out > 0) shapes = {Shape{shape_out, shape_in}};
    for (Shape s : shapes) {
      // Short rows (a LoRA adapter's B) are timed for dense formats; codes want whole groups.
      const int64_t whole = f.group > 0 ? f.group : 128;
      if (s.in % whole != 0 && (f.quant_bits != 0 || f.fp8)) {
        std::printf("%-8s %5lldx%-8lld skipped: IN not a multiple of its group\n", f.name,
                    static_cast<long long>(s.out_f), static_cast<long long>(s.in));
        continue;
      }
      const std::vector<int64_t> ts =
          only_t > 0 ? std::vector<int64_t>{only_t} : std::vector<int64_t>{1, 16, 64};
      for (int64_t t : ts) {
        const LinearResult r = TimeLinear(s.out_f, s.in, f, t, quick, hot);
        const double gbs = r.bytes / r.seconds / 1e9;
        const double gflops = 2.0 * s.out_f * s.in * t / r.seconds / 1e9;
        std::printf("%-8s %5lldx%-8lld %4lld %10.3f %10.1f %7.0f%% %10.1f\n", f.name,
                    static_cast<long long>(s.out_f), static_cast<long long>(s.in),
                    static_cast<long long>(t), r.seconds * 1e3, gbs, 100 * gbs / bw, gflops);
      }
    }
  }
  return 0;
}

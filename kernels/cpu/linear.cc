// Linear on the CPU: out[T, N] = x[T, K] @ w[N, K]^T (+ bias).
//
// Two paths:
//  - Small T (decode, T <= kSmallT): a streaming kernel. Output rows are split across the
//    thread pool; each thread reads every weight row it owns exactly once (in tiles of 4 rows
//    and chunks of kChunk columns), converts bf16/f16 to f32 in registers and applies it to all
//    T activation rows, which stay in cache. This is memory-bandwidth bound for T = 1.
//    AVX2/FMA/F16C code is chosen at run time; a portable scalar version is the fallback.
//    Each output element is summed in one fixed order (8 lanes over k, a fixed horizontal sum,
//    then the k % 8 tail), so a row's result does not depend on T, on the other rows in the
//    batch, or on the number of threads. bf16 weights on CPUs with AVX512_BF16 take their own
//    (linear_decode_bf16.cc: x rounded to bf16 as the prefill GEMM rounds it, 32 columns per
//    vdpbf16ps; batched decode of 4-16 rows ran 1.7-2.2x the f32-x kernel's speed).
//  - Large T (prefill): with AVX-512, our GEMM (linear_gemm_avx512.cc: weight panels of 32
//    rows converted to f32 once, each output one FMA chain in column order); bf16 weights on
//    CPUs with AVX512_BF16 their own (linear_gemm_bf16.cc: x rounded to bf16, as a bf16
//    model's matmul takes it in transformers, pairs of columns per vdpbf16ps); otherwise
//    OpenBLAS sgemm (blas.h: loaded at run time, with the kernels this CPU runs), one
//    single-threaded call per block of output rows on our pool (bf16/f16 weight blocks are
//    converted to f32 into a per-thread scratch first).
// Quantized weights (kernels/quantized.h) take both paths too: their codes are dequantized
// where bf16 would be converted ((code - zero) * scale, exactly the f32 weight transformers
// would multiply by), over the stored columns, against x gathered into the stored order; on
// AVX2, decode of 8- and 4-bit codes whose runs are whole 32-column blocks reads them
// interleaved 8 rows at a time and takes each block's scale and zero out of its sum instead
// (linear_panels.cc: the same up to rounding).
// With int8 activations on (SetInt8Activations, opt-in), 8- and 4-bit codes take the integer
// kernels instead on both paths: the panels' (linear_int8_panels.cc) without VNNI, and for 4-bit
// decode everywhere; with VNNI linear_q8_int8x.cc (8-bit decode) and linear_int8_gemm.cc.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernels/cpu/blas.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/linear_short_rows.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/quantized.h"

namespace tgis::kernels::cpu {

float WRow::ScalePortable(int64_t r) const { return compact() ? F16ToF32(scale_h[r]) : scale[r]; }

bool CpuHasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    // F16C from cpuid itself: clang's __builtin_cpu_supports does not know that name.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  return has;
}

namespace {

constexpr int64_t kChunk = 512;  // columns per chunk; a multiple of 8
constexpr int kTileRows = 4;     // weight rows per tile (8 when T = 1)

std::atomic<Isa> g_isa{Isa::kAuto};
std::atomic<bool> g_int8_activations{false};

bool UseAvx2() {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case Isa::kScalar:
      return false;
    case Isa::kAvx2:
      TGIS_CHECK(CpuHasAvx2(), "SetIsaForTesting(kAvx2) on a CPU without AVX2/FMA/F16C");
      return true;
    case Isa::kAvx512:
    case Isa::kAvx512Vnni:
    case Isa::kAvx512Bf16:
    case Isa::kAuto:
      break;
  }
  return CpuHasAvx2();
}

// AMD Zen 4 (family 0x19 with AVX-512) runs 512-bit instructions as two 256-bit halves, and a
// 512-bit permute at half that rate again.
bool Avx512AtHalfWidth() {
  static const bool zen4 = CpuHasAvx512() && __builtin_cpu_is("amd") && CpuFamily() == 0x19;
  return zen4;
}

// The AVX-512 streaming kernel, for the weights it takes (others fall back to AVX2). On Zen 4,
// 4-bit integer codes take the panels (linear_panels.cc, 16 lanes wide there): the AVX-512
// kernel's table lookup (a 512-bit permute per 16 weights) measured slower there than the
// panels' mask, convert and FMA per 8 (EPYC Zen 4, kernels_bench --quick --t=1 gptq4g32 --isa=
// avx2 against avx512: 17-21 against 10-14 GB/s; engine_bench TinyLlama GPTQ g32 decode 17.7-21.2
// against 12.6-15.3 tok/s, prefill alike), and their rows can then go (every path reads the
// panels); int8-activation prefill then runs on the panels too (135-161 against the VNNI GEMM's
// 205-216 tok/s there), for the codes' memory once instead of twice. Codes that index a table
// (nf4, fp4, MXFP4) have no panels; the same permute per 16 weights beat the AVX2 table kernel
// there too (kernels_bench --shape=5760x2880 --t=1 nf4 mxfp4, --isa=avx512 against avx2:
// 0.60-0.62 against 0.94-0.95 ms nf4, 0.71-0.75 against 1.01-1.02 mxfp4).
bool UseAvx512Stream(const QuantizedWeight* q) {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case Isa::kScalar:
    case Isa::kAvx2:
      return false;
    case Isa::kAvx512:
      TGIS_CHECK(CpuHasAvx512(), "SetIsaForTesting(kAvx512) on a CPU without AVX-512");
      break;
    case Isa::kAvx512Vnni:
      TGIS_CHECK(CpuHasAvx512Vnni(), "SetIsaForTesting(kAvx512Vnni) on a CPU without VNNI");
      break;
    case Isa::kAvx512Bf16:
      TGIS_CHECK(CpuHasAvx512Vnni() && CpuHasAvx512Bf16(),
                 "SetIsaForTesting(kAvx512Bf16) on a CPU without VNNI and AVX512_BF16");
      break;
    case Isa::kAuto:
      if (!CpuHasAvx512()) return false;
      if (q != nullptr && q->bits == 4 && q->codebook.empty() && Avx512AtHalfWidth()) return false;
      break;
  }
  return WholeBlockRuns(q);
}
// The AVX-512 kernels of every kind (decode, GEMM, VNNI), for weights other than tables: those
// take the AVX-512 streaming kernel only (UseAvx512Stream) and the AVX2 paths otherwise.
bool UseAvx512(const QuantizedWeight* q) {
  return (q == nullptr || q->codebook.empty()) && UseAvx512Stream(q);
}

// Whether the ISA setting (SetIsaForTesting) and the CPU allow AVX-512 kernels at all, whatever
// the weight (f32 and bf16 x, the GEMM, panel pairs).
bool Avx512Allowed() { return UseAvx512Stream(nullptr); }

// Integer dot products for 8- and 4-bit codes (among the weights UseAvx512 takes).
bool UseVnni() {
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  return isa == Isa::kAvx512Vnni || isa == Isa::kAvx512Bf16 ||
         (isa == Isa::kAuto && CpuHasAvx512Vnni());
}

// Whether bf16 weights multiply x rounded to bf16 (linear_gemm_bf16.cc, linear_decode_bf16.cc).
bool UseBf16Dot() {
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  return Avx512Allowed() && (isa == Isa::kAvx512Bf16 || (isa == Isa::kAuto && CpuHasAvx512Bf16()));
}

// Which kernels multiply 8- and 4-bit codes by int8-rounded x (SetInt8Activations), if any:
// VNNI where the AVX-512 kernels run, else AVX2 (the panels, linear_int8_panels.cc), on the
// same weights (the rounding, and so the result up to f32 summation order, does not depend on
// which).
enum class Int8Path { kNone, kVnni, kAvx2 };
Int8Path Int8PathFor(const QuantizedWeight* q) {
  if (!g_int8_activations.load(std::memory_order_relaxed)) return Int8Path::kNone;
  if (UseAvx512(q) && UseVnni()) return Int8Path::kVnni;
  return UseAvx2() && WholeBlockRuns(q) ? Int8Path::kAvx2 : Int8Path::kNone;
}

// Whether every path of an 8- or 4-bit weight reads its panels, so that PrepareCpuWeight may
// let the rows go: on AVX2 where the AVX-512 kernels do not take it. Exact decode reads them
// (linear_panels.cc), int8-activation decode and prefill too (linear_int8_panels.cc), exact
// prefill its f32 rows made from them (PanelRowsF32).
bool EveryPathTakesPanels(const QuantizedWeight* q) { return UseAvx2() && !UseAvx512(q); }

// 8- and 4-bit codes against int8-rounded x with AVX2 code, at any T (linear_int8_panels.cc).
// False (nothing written: the exact path runs) when x has a NaN or inf.
bool PanelsInt8(const SmallArgs& a) {
  const CodePanels* panels = CodePanelsOf(*a.q);
  thread_local Int8Blocks x;
  if (panels == nullptr || !x.Prepare(a.x, a.t, a.k)) return false;
  Int8PanelsLinear(a, x, *panels, UseVnni());
  return true;
}

template <WFmt W>
inline float LoadScalar(const WRow& row, int64_t i) {
  if constexpr (W == WFmt::kF32) {
    return static_cast<const float*>(row.p)[i];
  } else if constexpr (W == WFmt::kBF16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row.p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else if constexpr (W == WFmt::kF16) {
    return F16ToF32(static_cast<const uint16_t*>(row.p)[i]);
  } else if constexpr (W == WFmt::kF8) {
    // Zero 0: the value times its run's scale, as Dequantize computes it.
    return Fp8E4M3ToF32(static_cast<const uint8_t*>(row.p)[i]) * row.scale[row.block_run[i / 8]];
  } else if constexpr (W == WFmt::kLut4) {
    const int code = (static_cast<const uint8_t*>(row.p)[i / 2] >> (4 * (i % 2))) & 0xF;
    return row.lut[code] * row.ScalePortable(row.block_run[i / 8]);
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(row.p);
    const int code = W == WFmt::kQ8 ? c[i] : (c[i / 2] >> (4 * (i % 2))) & 0xF;
    const int32_t r = row.block_run[i / 8];
    return (static_cast<float>(code) - row.Zero(r)) * row.ScalePortable(r);
  }
}

// Bytes one weight takes (for work splitting).
template <WFmt W>
constexpr double BytesPerWeight() {
  return W == WFmt::kF32                      ? 4
         : W == WFmt::kQ8 || W == WFmt::kF8   ? 1
         : W == WFmt::kQ4 || W == WFmt::kLut4 ? 0.5
                                              : 2;
}

// ---- scalar fallback ---------------------------------------------------------------------

template <WFmt W>
void SmallScalar(const SmallArgs& a, int64_t n0, int64_t n1) {
  thread_local std::vector<float> row;
  row.resize(a.k);
  for (int64_t n = n0; n < n1; ++n) {
    const WRow wr = RowOf<W>(a, n);
    for (int64_t i = 0; i < a.k; ++i) row[i] = LoadScalar<W>(wr, i);
    for (int64_t t = 0; t < a.t; ++t) {
      const float* xr = a.x + t * a.k;
      float s[4] = {0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 4 <= a.k; i += 4) {
        s[0] += row[i] * xr[i];
        s[1] += row[i + 1] * xr[i + 1];
        s[2] += row[i + 2] * xr[i + 2];
        s[3] += row[i + 3] * xr[i + 3];
      }
      float sum = (s[0] + s[1]) + (s[2] + s[3]);
      for (; i < a.k; ++i) sum += row[i] * xr[i];
      if (a.bias) sum += a.bias[n];
      a.out[t * a.n + n] = sum;
    }
  }
}

// ---- AVX2 / FMA / F16C --------------------------------------------------------------------

// The codes of columns [i, i + 8) of a quantized row, one per int32 lane; i a multiple of 8.
template <WFmt W>
TGIS_AVX2 inline __attribute__((always_inline)) __m256i Codes8(const uint8_t* codes, int64_t i) {
  if constexpr (W == WFmt::kQ8) {
    int64_t eight;
    std::memcpy(&eight, codes + i, 8);
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
  } else {
    uint32_t packed;
    std::memcpy(&packed, codes + i / 2, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)), shifts),
                            _mm256_set1_epi32(0xF));
  }
}

// Weights [i, i + 8 * N) of a quantized row whose columns there all lie in run `r`, as N
// vectors: (code - zero) * scale, each rounded once, as Dequantize computes them. Taking a
// whole 32-column block at once reads the run's constants once instead of per 8 columns,
// which was most of the AVX2 kernel's instructions for 4-bit codes.
template <WFmt W, int N>
TGIS_AVX2 inline __attribute__((always_inline)) void LoadRun(const WRow& row, int64_t i, int32_t r,
                                                             __m256* out) {
  const __m256 scale = _mm256_set1_ps(row.Scale(r));
  if constexpr (W == WFmt::kLut4) {
    // The table times the run's scale, then each code picks from its low and high halves (its
    // low 3 bits) and its bit 3, moved to the sign, chooses between them: table[code] * scale,
    // the product LoadScalar rounds. Codes8's higher bits are shifted out, so no mask.
    const __m256 low = _mm256_mul_ps(_mm256_loadu_ps(row.lut), scale);
    const __m256 high = _mm256_mul_ps(_mm256_loadu_ps(row.lut + 8), scale);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) {
      uint32_t packed;
      std::memcpy(&packed, row.codes() + (i + 8 * j) / 2, 4);
      const __m256i code = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)),
                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
      out[j] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, code),
                                _mm256_permutevar8x32_ps(high, code),
                                _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    }
    return;
  }
  const __m256 zero = _mm256_set1_ps(row.Zero(r));
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const __m256 code = _mm256_cvtepi32_ps(Codes8<W>(row.codes(), i + 8 * j));
    out[j] = _mm256_mul_ps(_mm256_sub_ps(code, zero), scale);
  }
}

// Weights [i, i + 8) of a row as f32; i is a multiple of 8 for quantized rows.
template <WFmt W>
TGIS_AVX2 inline __m256 Load8(const WRow& row, int64_t i) {
  if constexpr (W == WFmt::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row.p) + i);
  } else if constexpr (W == WFmt::kBF16) {
    return Widen8Bf16(static_cast<const uint16_t*>(row.p) + i);
  } else if constexpr (W == WFmt::kF16) {
    return Widen8F16(static_cast<const uint16_t*>(row.p) + i);
  } else if constexpr (W == WFmt::kF8) {
    // Magnitude bits to f32's exponent and mantissa top, the sign to its sign, times 2^120
    // (exact), times the row's scale: Fp8E4M3ToF32(code) * scale, rounded once as there.
    int64_t eight;
    std::memcpy(&eight, static_cast<const uint8_t*>(row.p) + i, 8);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
    const __m256i bits =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20),
                        _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f)),
                         _mm256_set1_ps(row.scale[row.block_run[i / 8]]));
  } else {
    __m256 v;
    LoadRun<W, 1>(row, i, row.block_run[i / 8], &v);
    return v;
  }
}

// Weights [i, i + 32) of a quantized row as four vectors: when the block lies in one run
// (the usual group sizes), from that run's constants read once.
template <WFmt W>
TGIS_AVX2 inline __attribute__((always_inline)) void LoadBlock(const WRow& row, int64_t i,
                                                               __m256* out) {
  const int32_t* run = row.block_run + i / 8;
  if (run[0] == run[3]) {  // runs are contiguous: the first and last block's run is all of it
    LoadRun<W, 4>(row, i, run[0], out);
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) LoadRun<W, 1>(row, i + 8 * j, run[j], out + j);
  }
}

// Weights [i0, i0 + len) of a row as f32 into dst; i0 and len multiples of 8.
template <WFmt W>
TGIS_AVX2 inline void ConvertAvx2(const WRow& row, int64_t i0, int64_t len, float* dst) {
  int64_t k = 0;
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4 || W == WFmt::kLut4) {
    for (; k + 32 <= len; k += 32) {
      __m256 v[4];
      LoadBlock<W>(row, i0 + k, v);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + k + 8 * j, v[j]);
    }
  }
  for (; k < len; k += 8) _mm256_storeu_ps(dst + k, Load8<W>(row, i0 + k));
}

// acc[r * acc_stride + t] += sum over k in [0, len) of w_r[k0 + k] * x[t * ldx + k], per lane.
template <int R, int TT, WFmt W>
TGIS_AVX2 inline void Micro(const WRow* wrows, int64_t k0, const float* x, int64_t ldx, int64_t len,
                            __m256* acc, int64_t acc_stride) {
  __m256 a[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) a[r][t] = acc[r * acc_stride + t];
  }
  int64_t k = 0;
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4 || W == WFmt::kLut4) {
    // 32 columns at a time, each row's four weight vectors at once. The FMAs into each
    // accumulator keep their column order, so the sums are bitwise those of 8-column steps.
    for (; k + 32 <= len; k += 32) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256 wv[4];
        LoadBlock<W>(wrows[r], k0 + k, wv);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 4
          for (int t = 0; t < TT; ++t)
            a[r][t] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * ldx + k + 8 * j), a[r][t]);
        }
      }
    }
  }
  for (; k < len; k += 8) {
    if constexpr (TT == 1) {
      const __m256 xv = _mm256_loadu_ps(x + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        a[r][0] = _mm256_fmadd_ps(Load8<W>(wrows[r], k0 + k), xv, a[r][0]);
    } else {
      __m256 wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wv[r] = Load8<W>(wrows[r], k0 + k);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const __m256 xv = _mm256_loadu_ps(x + t * ldx + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) a[r][t] = _mm256_fmadd_ps(wv[r], xv, a[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r * acc_stride + t] = a[r][t];
  }
}

// All T rows against weight rows [n, n + R), over K in chunks.
template <int R, WFmt Wt>
TGIS_AVX2 void TileAvx2(const SmallArgs& a, int64_t n) {
  const int64_t k8 = a.k & ~int64_t{7};
  const int64_t t_count = a.t;
  static_assert(R <= 2 * kTileRows);
  alignas(32) __m256 acc[kTileRows * kSmallT];  // R * T <= 8 * 1 or 4 * 16
  for (int64_t i = 0; i < R * t_count; ++i) acc[i] = _mm256_setzero_ps();
  alignas(64) static thread_local float scratch[2 * kTileRows * kChunk];
  WRow wr[R];
  for (int r = 0; r < R; ++r) wr[r] = RowOf<Wt>(a, n + r);

  // With T <= 2 every weight vector is used once per row: convert it in registers. Otherwise
  // f32 weights are read directly (from L1 after the first t pair) and bf16/f16 chunks are
  // converted once into scratch.
  const bool direct = t_count <= 2 || Wt == WFmt::kF32;
  for (int64_t c0 = 0; c0 < k8; c0 += kChunk) {
    const int64_t len = std::min(kChunk, k8 - c0);
    if (direct) {
      int64_t t0 = 0;
      for (; t0 + 2 <= t_count; t0 += 2)
        Micro<R, 2, Wt>(wr, c0, a.x + t0 * a.k + c0, a.k, len, acc + t0, t_count);
      if (t0 < t_count) Micro<R, 1, Wt>(wr, c0, a.x + t0 * a.k + c0, a.k, len, acc + t0, t_count);
    } else {
      WRow sr[R];
      for (int r = 0; r < R; ++r) {
        float* dst = scratch + r * kChunk;
        ConvertAvx2<Wt>(wr[r], c0, len, dst);
        sr[r].p = dst;
      }
      int64_t t0 = 0;
      for (; t0 + 2 <= t_count; t0 += 2)
        Micro<R, 2, WFmt::kF32>(sr, 0, a.x + t0 * a.k + c0, a.k, len, acc + t0, t_count);
      if (t0 < t_count)
        Micro<R, 1, WFmt::kF32>(sr, 0, a.x + t0 * a.k + c0, a.k, len, acc + t0, t_count);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < t_count; ++t) {
      float s = HSum8(acc[r * t_count + t]);
      const float* xr = a.x + t * a.k;
      for (int64_t k = k8; k < a.k; ++k) s += LoadScalar<Wt>(wr[r], k) * xr[k];
      if (a.bias) s += a.bias[n + r];
      a.out[t * a.n + n + r] = s;
    }
  }
}

template <WFmt W>
TGIS_AVX2 void SmallAvx2(const SmallArgs& a, int64_t n0, int64_t n1) {
  // The tile height changes which rows share a pass, never how a row is summed.
  int64_t n = n0;
  if (a.t == 1) {  // 8 independent FMA chains hide the FMA latency
    for (; n + 2 * kTileRows <= n1; n += 2 * kTileRows) TileAvx2<2 * kTileRows, W>(a, n);
  }
  for (; n + kTileRows <= n1; n += kTileRows) TileAvx2<kTileRows, W>(a, n);
  for (; n < n1; ++n) TileAvx2<1, W>(a, n);
}

// A weight whose codes PrepareCpuWeight kept only in the panels runs only where the kernels
// read them.
void CheckCodesReadable(const QuantizedWeight* q, bool panels_path) {
  TGIS_CHECK(q == nullptr || !q->codes_only_in_panels || panels_path,
             "Linear: the weight's codes are kept only in the AVX2 panels "
             "(PrepareCpuWeight), which the %s path does not read",
             ActiveIsaName());
}

template <WFmt W>
void SmallT(const SmallArgs& args) {
  // Tables: the AVX-512 streaming kernel or else AVX2's own (below), never the other AVX-512
  // kernels.
  const bool avx512 = W == WFmt::kLut4 ? UseAvx512Stream(args.q) : UseAvx512(args.q);
  const bool avx2 = UseAvx2();
  CheckCodesReadable(args.q, !avx512 && avx2);
  const int64_t tiles = (args.n + kTileRows - 1) / kTileRows;
  // At least ~64 KB of weights per parallel chunk.
  const int64_t grain = std::max<int64_t>(
      1, static_cast<int64_t>((64 << 10) / (kTileRows * args.k * BytesPerWeight<W>() + 1)));
  if (W == WFmt::kBF16 && Bf16DotTakes(DType::kBF16, args.k)) return SmallBf16Dot(args, grain);
  const Int8Path int8 = Int8PathFor(args.q);
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4) {
    // The panels: 4-bit codes on VNNI machines too (summed with vpdpbusd there). The VNNI
    // row-at-a-time kernel they replaced measured 0.5-0.66x llama.cpp's repacked Q4_0 on Zen 4
    // and Zen 5; the panels 0.76-1.0x on Zen 4 (benchmarks/README.md, session 26).
    const bool panels = int8 == Int8Path::kAvx2 || (W == WFmt::kQ4 && int8 != Int8Path::kNone);
    if (panels && PanelsInt8(args)) return;
  }
  if constexpr (W == WFmt::kQ8) {
    thread_local Int8X8 int8x;
    if (int8 == Int8Path::kVnni && int8x.Prepare(args.x, args.t, args.k)) {
      const Int8X8* x = &int8x;
      ParallelFor(tiles, grain, [&](int64_t b, int64_t e) {
        SmallQ8Int8X(args, *x, b * kTileRows, std::min(args.n, e * kTileRows));
      });
      return;
    }
  }
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4) {
    // Else (x with a NaN or inf, 8-bit codes of a width not a multiple of 64 on VNNI) the
    // dequantizing kernels.
    if (EveryPathTakesPanels(args.q)) {
      if (const CodePanels* panels = CodePanelsOf(*args.q)) {
        return PanelsExactLinear(args, *panels, Avx512Allowed());
      }
    }
  }
  SmallArgs a = args;
  if (W == WFmt::kLut4 && !avx512) {
    const bool lut = avx2 && LutDecodeTakes(a);
    thread_local std::vector<float> ordered;
    if (lut) {
      ordered.resize(a.t * a.k);
      LutOrderX(a.x, a.t, a.k, ordered.data());
    }
    SmallArgs b = a;
    if (lut) b.x = ordered.data();  // workers read the calling thread's copy
    ParallelFor(tiles, grain, [&](int64_t i, int64_t e) {
      const int64_t n0 = i * kTileRows, n1 = std::min(b.n, e * kTileRows);
      lut ? LutDecodeAvx2(b, n0, n1) : avx2 ? SmallAvx2<W>(b, n0, n1) : SmallScalar<W>(b, n0, n1);
    });
    return;
  }
  if (Avx512OrdersX(W) && avx512) a.x = Avx512OrderX(W, a.x, a.t, a.k);
  thread_local FixedPointX fixed;
  // 8-bit codes only: 4-bit codes are faster through the AVX-512 kernel's permute table
  // (measured: kernels_bench --hot, 1 thread, 1024x2048 GPTQ g128: 24.8 against 19 G weights/s).
  const bool vnni = W == WFmt::kQ8 && avx512 && UseVnni() &&
                    fixed.Prepare(a.x, a.t, a.k, a.q->block_run.data<int32_t>());
  const FixedPointX* fx = &fixed;  // workers read the calling thread's copy
  ParallelFor(tiles, grain, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * kTileRows;
    const int64_t n1 = std::min(a.n, e * kTileRows);
    if constexpr (W == WFmt::kQ8) {
      if (vnni) return SmallVnni<W>(a, *fx, n0, n1);
    }
    if (avx512) {
      SmallAvx512<W>(a, n0, n1);
    } else if (avx2) {
      SmallAvx2<W>(a, n0, n1);
    } else {
      SmallScalar<W>(a, n0, n1);
    }
  });
}

// ---- large T: our AVX-512 GEMM, or OpenBLAS -----------------------------------------------

template <WFmt W>
TGIS_AVX2 void ConvertRowAvx2(const WRow& src, int64_t n, float* dst) {
  const int64_t n8 = n & ~int64_t{7};
  ConvertAvx2<W>(src, 0, n8, dst);
  for (int64_t i = n8; i < n; ++i) dst[i] = LoadScalar<W>(src, i);
}

// Rows [r0, r0 + rows) of the weight as f32 into dst [rows, K].
template <WFmt W>
void ConvertRows(const SmallArgs& a, int64_t r0, int64_t rows, float* dst, bool avx2) {
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4) {
    if (a.q->codes_only_in_panels) return PanelRowsF32(*CodePanelsOf(*a.q), r0, rows, dst);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const WRow src = RowOf<W>(a, r0 + r);
    float* d = dst + r * a.k;
    if (avx2) {
      ConvertRowAvx2<W>(src, a.k, d);
    } else {
      for (int64_t i = 0; i < a.k; ++i) d[i] = LoadScalar<W>(src, i);
    }
  }
}

template <WFmt W>
void LargeT(const SmallArgs& a) {
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4) {
    const Int8Path int8 = Int8PathFor(a.q);
    // Without VNNI the panels at every T (linear_int8_panels.cc).
    if (int8 == Int8Path::kAvx2 ? PanelsInt8(a) : int8 == Int8Path::kVnni && LargeInt8Gemm<W>(a)) {
      return;
    }
  }
  [[maybe_unused]] const bool avx2 = UseAvx2();
  CheckCodesReadable(a.q, !UseAvx512(a.q) && avx2);
  const int64_t threads = ThreadPool::Global().size();
  if (W == WFmt::kBF16 && Bf16DotTakes(DType::kBF16, a.k)) {
    LargeBf16DotGemm(a);
  } else if (Avx512Allowed()) {
    LargeAvx512Gemm(a, [&](int64_t n0, int rows, float* scratch) -> const float* {
      if constexpr (W == WFmt::kF32) {
        return static_cast<const float*>(a.w) + n0 * a.k;
      } else {
        ConvertRows<W>(a, n0, rows, scratch, avx2);
        return scratch;
      }
    });
  } else if constexpr (W == WFmt::kF32) {
    const int64_t grain = std::max<int64_t>(16, (a.n + threads - 1) / threads);
    ParallelFor(a.n, grain, [&](int64_t b, int64_t e) {
      SgemmNT(static_cast<int>(a.t), static_cast<int>(e - b), static_cast<int>(a.k), a.x,
              static_cast<int>(a.k), static_cast<const float*>(a.w) + b * a.k,
              static_cast<int>(a.k), a.out + b, static_cast<int>(a.n));
    });
  } else {
    // Convert blocks of up to ~1M weights (4 MB of f32) at a time.
    const int64_t block =
        std::clamp<int64_t>((int64_t{1} << 20) / std::max<int64_t>(1, a.k) / 16 * 16, 16, 256);
    const int64_t grain = std::max<int64_t>(block, (a.n + threads - 1) / threads);
    ParallelFor(a.n, grain, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> buf;
      buf.resize(block * a.k);
      for (int64_t r0 = b; r0 < e; r0 += block) {
        const int64_t rows = std::min(block, e - r0);
        ConvertRows<W>(a, r0, rows, buf.data(), avx2);
        SgemmNT(static_cast<int>(a.t), static_cast<int>(rows), static_cast<int>(a.k), a.x,
                static_cast<int>(a.k), buf.data(), static_cast<int>(a.k), a.out + r0,
                static_cast<int>(a.n));
      }
    });
  }
  if (a.bias) {
    ParallelFor(a.t, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t n = 0; n < a.n; ++n) a.out[t * a.n + n] += a.bias[n];
    });
  }
}

template <WFmt W>
void Dispatch(const SmallArgs& a) {
  if (a.t <= kSmallT) {
    SmallT<W>(a);
  } else {
    LargeT<W>(a);
  }
}

}  // namespace

void SetIsaForTesting(Isa isa) { g_isa.store(isa); }

bool Int8ActivationsAvailable() { return CpuHasAvx2(); }

bool Bf16DotTakes(DType w, int64_t k) { return w == DType::kBF16 && k % 2 == 0 && UseBf16Dot(); }

void SetInt8Activations(bool on) { g_int8_activations.store(on); }

size_t DerivedLayoutBytes() { return PanelBytes(); }

bool PrepareQuantized(const QuantizedWeight& q) {
  if ((q.bits != 4 && q.bits != 8) || q.fp8 || !q.codebook.empty()) return false;
  // Where every path reads the panels they are made now and the rows may go; with AVX-512
  // they serve the int8-activation kernels only, beside the rows (4-bit decode, and 8- and
  // 4-bit codes at every T without VNNI).
  if (EveryPathTakesPanels(&q)) return CodePanelsOf(q) != nullptr;
  const Int8Path int8 = Int8PathFor(&q);
  if (int8 == Int8Path::kAvx2 || (q.bits == 4 && int8 != Int8Path::kNone)) CodePanelsOf(q);
  return false;
}

bool UseAvx2Kernels() { return UseAvx2(); }

bool IsaAvailable(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      return CpuHasAvx512Vnni();
    case Isa::kAvx512Bf16:
      return CpuHasAvx512Vnni() && CpuHasAvx512Bf16();
    case Isa::kAvx2:
      return CpuHasAvx2();
    case Isa::kAvx512:
      return CpuHasAvx512();
    case Isa::kAuto:
    case Isa::kScalar:
      break;
  }
  return true;
}

Isa IsaNamed(std::string_view name) {
  return name == "scalar"   ? Isa::kScalar
         : name == "avx2"   ? Isa::kAvx2
         : name == "avx512" ? Isa::kAvx512
         : name == "vnni"   ? Isa::kAvx512Vnni
         : name == "bf16"   ? Isa::kAvx512Bf16
                            : Isa::kAuto;
}

const char* ActiveIsaName() {
  if (Avx512Allowed()) {
    if (UseBf16Dot()) return "avx512+vnni+bf16";
    return UseVnni() ? "avx512+vnni" : "avx512";
  }
  return UseAvx2() ? "avx2+fma" : "scalar";
}

std::string PrefillGemmName() {
  if (UseBf16Dot()) return "avx512 (bf16 weights: avx512_bf16 on x rounded to bf16)";
  return Avx512Allowed() ? "avx512" : "OpenBLAS " + BlasCoreName();
}

void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* out) {
  const char* op = "Linear";
  CheckF32(x, op, "x");
  const QuantizedWeight* q = w.quantized();
  TGIS_CHECK(
      w.defined() && w.rank() == 2 && (q || IsFloatDType(w.dtype())) && w.device() == Device::kCpu,
      "Linear: w must be a [out, in] f32/bf16/f16 or quantized CPU tensor");
  const int64_t n = w.dim(0);
  const int64_t k = w.dim(1);
  TGIS_CHECK(x.dim(-1) == k, "Linear: x has %lld features, w expects %lld",
             static_cast<long long>(x.dim(-1)), static_cast<long long>(k));
  const int64_t t_count = k == 0 ? x.numel() : x.numel() / k;
  Shape shape = x.shape();
  shape.back() = n;
  PrepareOut(out, shape, op);
  TGIS_CHECK(out->raw() != x.raw(), "Linear: out must not alias x");
  std::vector<float> bias_f;
  const float* bias_p = nullptr;
  if (bias != nullptr && bias->defined()) {
    TGIS_CHECK(bias->numel() == n, "Linear: bias has %lld elements, want %lld",
               static_cast<long long>(bias->numel()), static_cast<long long>(n));
    if (bias->dtype() == DType::kF32) {
      bias_p = bias->data<float>();
    } else {
      bias_f = ToFloatVector(*bias);
      bias_p = bias_f.data();
    }
  }
  if (t_count == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t t = 0; t < t_count; ++t)
      for (int64_t j = 0; j < n; ++j) out->data<float>()[t * n + j] = bias_p ? bias_p[j] : 0.f;
    return;
  }
  if (q != nullptr) {
    // x in the stored column order (padding reads 0), when that is not x's own order.
    thread_local std::vector<float> gathered;
    const float* xs = x.data<float>();
    if (q->gather.defined()) {
      const int32_t* src = q->gather.data<int32_t>();
      gathered.resize(t_count * q->stored_in);
      float* const to = gathered.data();  // this thread's buffer (workers have their own)
      ParallelFor(t_count, 1, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          float* dst = to + t * q->stored_in;
          const float* row = xs + t * k;
          for (int64_t j = 0; j < q->stored_in; ++j) dst[j] = src[j] < 0 ? 0.f : row[src[j]];
        }
      });
      xs = to;
    }
    const SmallArgs a{xs, t_count, q->stored_in, q->codes.raw(), q, n, bias_p, out->data<float>()};
    if (q->fp8) return Dispatch<WFmt::kF8>(a);
    if (!q->codebook.empty()) return Dispatch<WFmt::kLut4>(a);
    return q->bits == 8 ? Dispatch<WFmt::kQ8>(a) : Dispatch<WFmt::kQ4>(a);
  }
  if (w.dtype() == DType::kF32 && ShortRowsTake(k)) {
    return ShortRowsLinear(
        {x.data<float>(), t_count, k, w.data<float>(), n, bias_p, out->data<float>()});
  }
  const SmallArgs a{x.data<float>(), t_count, k, w.raw(), nullptr, n, bias_p, out->data<float>()};
  switch (w.dtype()) {
    case DType::kF32:
      return Dispatch<WFmt::kF32>(a);
    case DType::kBF16:
      return Dispatch<WFmt::kBF16>(a);
    case DType::kF16:
      return Dispatch<WFmt::kF16>(a);
    default:
      TGIS_FATAL("Linear: unsupported weight dtype %s", DTypeName(w.dtype()));
  }
}

}  // namespace tgis::kernels::cpu

// Internal to the CPU Linear: what its streaming (decode) kernels share, so that each
// instruction set's kernel can live in its own file.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/quantized.h"

namespace tgis::kernels::cpu {

constexpr int64_t kSmallT = 16;  // T up to this takes the streaming (decode) kernels
// The AVX-512 and VNNI kernels' step: 32 columns, each inside one run (see WholeBlockRuns).
constexpr int64_t kAvx512Block = 32;

bool CpuHasAvx2();  // AVX2, FMA and F16C
#define TGIS_AVX2 __attribute__((target("avx2,fma,f16c")))

// The sum of v's 8 lanes, in one fixed order.
TGIS_AVX2 inline float HSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight bf16 or f16 values widened to f32 (both exact).
TGIS_AVX2 inline __m256 Widen8Bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
TGIS_AVX2 inline __m256 Widen8F16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// How a weight row is stored: a float dtype, quantized codes of 8 or 4 bits, float8 e4m3
// bytes, or 4-bit codes that index a table (QuantizedWeight::codebook).
enum class WFmt { kF32, kBF16, kF16, kQ8, kQ4, kF8, kLut4 };

// One weight row: its values (or codes) and, quantized, its per-run scales and zeros: f32
// (`scale`, `zero`), or for compact 4-bit weights (QuantizedWeight::compact) f16 scales and
// byte zeros (`scale_h`, `zero_b`; `scale` and `zero` are then null). Readers of 4-bit rows
// take the run constants through Scale and Zero (or their own vector loads of both forms).
struct WRow {
  const void* p = nullptr;
  const float* scale = nullptr;
  const float* zero = nullptr;
  const int32_t* block_run = nullptr;  // shared by all rows: the run of each 8-column block
  const uint16_t* scale_h = nullptr;
  const uint8_t* zero_b = nullptr;
  const float* lut = nullptr;  // kLut4: the 16 values the codes index

  const uint8_t* codes() const { return static_cast<const uint8_t*>(p); }
  bool compact() const { return scale_h != nullptr; }
  // Run r's constants. The f16 scale widens with F16C where the caller is compiled for it.
  TGIS_AVX2 float Scale(int64_t r) const { return compact() ? _cvtsh_ss(scale_h[r]) : scale[r]; }
  float Zero(int64_t r) const { return compact() ? static_cast<float>(zero_b[r]) : zero[r]; }
  // The same for callers without AVX2 (the scalar kernel).
  float ScalePortable(int64_t r) const;
};

// Arguments of one streaming-kernel call over output rows [n0, n1).
struct SmallArgs {
  const float* x;  // [T, K]
  int64_t t;
  int64_t k;
  const void* w;             // [N, K] of the weight dtype, or the codes of `q`
  const QuantizedWeight* q;  // quantized weights, else null
  int64_t n;
  const float* bias;  // [N] or null
  float* out;         // [T, N]
};

// out[t, n] = sums[t] (+ bias[n]) for every token: the end of each int8 kernel's row.
inline void StoreRow(const SmallArgs& a, int64_t n, const float* sums) {
  for (int64_t t = 0; t < a.t; ++t) a.out[t * a.n + n] = a.bias ? sums[t] + a.bias[n] : sums[t];
}

template <WFmt W>
inline WRow RowOf(const SmallArgs& a, int64_t n) {
  if constexpr (W == WFmt::kQ8 || W == WFmt::kQ4 || W == WFmt::kF8 || W == WFmt::kLut4) {
    const int64_t runs = a.q->runs();
    WRow row{static_cast<const char*>(a.w) + n * a.q->codes.dim(1)};
    row.block_run = a.q->block_run.data<int32_t>();
    if constexpr (W == WFmt::kLut4) row.lut = a.q->codebook.data();
    if (a.q->compact()) {
      row.scale_h = a.q->scales.data<uint16_t>() + n * runs;
      row.zero_b = a.q->zeros.data<uint8_t>() + n * runs;
    } else {
      row.scale = a.q->scales.data<float>() + n * runs;
      row.zero = a.q->zeros.data<float>() + n * runs;
    }
    return row;
  } else {
    constexpr size_t kSize = W == WFmt::kF32 ? 4 : 2;
    return {static_cast<const char*>(a.w) + n * a.k * static_cast<int64_t>(kSize)};
  }
}

// How far ahead, in bytes, the kernels that take one weight row after another fetch its codes:
// a weight's rows are consecutive, so that is one sequential stream, and the fetch runs on
// across row ends (a prefetch never faults, also past the weight's end). On EPYC Zen 5 4096
// bytes measured best against the hardware prefetcher alone, +5-40% depending on the kernel
// (kernels_bench --quick --t=1 [--int8-activations] int8 gptq8 gptq4 gptq4g32, old and new
// alternated); 2048 and 8192 a little less, 16384 no better.
constexpr int64_t kCodesAhead = 4096;
inline void PrefetchCodesAhead(const uint8_t* codes, int64_t ahead = kCodesAhead) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + ahead), _MM_HINT_T0);
}

// Decode of codes that index a table (QuantizedWeight::codebook) with AVX2 (linear_lut.cc),
// where LutDecodeTakes the call (T <= kSmallT, runs of whole 32-column blocks; else the
// generic AVX2 tile runs): output rows [n0, n1), x ([t, k]) in the kernel's column order,
// which LutOrderX makes (each 8 columns as 0 2 4 6 1 3 5 7).
bool LutDecodeTakes(const SmallArgs& a);
void LutOrderX(const float* x, int64_t t, int64_t k, float* out);
void LutDecodeAvx2(const SmallArgs& a, int64_t n0, int64_t n1);

// The AVX-512 streaming kernel (linear_avx512.cc). It takes every float weight and the
// quantized ones whose runs are whole 32-column blocks; others stay on AVX2.
bool CpuHasAvx512();
// True for float weights (null) and for quantized ones where every 32-column block of stored
// columns lies inside one run (the usual group sizes 32, 64, 128 and per-row scales).
bool WholeBlockRuns(const QuantizedWeight* q);
// The AVX-512 kernel applies 4-bit codes and bf16 rows to x in its own column order within
// each 32-column block: 4-bit codes (integer or table) a block's even columns, then its odd
// ones; bf16 rows, widened by interleaving each 16-bit value with a zero within 128-bit lanes,
// columns 0-3 8-11 16-19 24-27 and then 4-7 12-15 20-23 28-31. Avx512OrderX reorders [t, k]
// rows of x for format w into rows of Avx512OrderedWidth(k) (k rounded up to whole blocks,
// zeros past k), on a cache line, in the calling thread's buffer (valid until its next call).
constexpr bool Avx512OrdersX(WFmt w) {
  return w == WFmt::kQ4 || w == WFmt::kLut4 || w == WFmt::kBF16;
}
int64_t Avx512OrderedWidth(int64_t k);
const float* Avx512OrderX(WFmt w, const float* x, int64_t t, int64_t k);
template <WFmt W>
void SmallAvx512(const SmallArgs& a, int64_t n0, int64_t n1);

// What the VNNI kernels (linear_vnni.cc, linear_q8_int8x.cc, linear_int8_gemm.cc) are compiled
// for.
#define TGIS_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

// The VNNI kernel for 8-bit codes (linear_vnni.cc), on the weights WholeBlockRuns.
bool CpuHasAvx512Vnni();
// Each token's x as 31-bit fixed point (hi * 2^15 + lo) times 2^exponent, and the column
// segments the kernel sums in integers (one run's columns each, bounded in length).
struct FixedPointX {
  struct Seg {
    int64_t k0, k1;  // kernel columns, multiples of 32
    int32_t run;
  };
  std::vector<int16_t> hi, lo;  // [t, k]
  std::vector<int> exponent;    // [t]
  std::vector<Seg> segments;
  // From x [t, k] in the kernel's column order; false (and unusable) when x has a NaN or inf.
  bool Prepare(const float* x, int64_t t, int64_t k, const int32_t* block_run);
};
template <WFmt W>
void SmallVnni(const SmallArgs& a, const FixedPointX& fx, int64_t n0, int64_t n1);

// x rounded to int8 as the opt-in int8-activation kernels multiply it (SetInt8Activations):
// per token and per 32 columns, q = nearbyint(x * (127 / absmax)) with scale absmax / 127 (a
// block of zeros, or of values so small that 127 / absmax overflows, is zeros with scale 0).
// Prepared with AVX2 (linear_int8_gemm.cc): callers have checked for it.
//
// Its kernels: AVX-512 VNNI ones on the rows (vpdpbusd: 4 products summed per int32 lane in one
// instruction; 8-bit decode and the prefill GEMM) and AVX2 ones on the panels (8-bit codes
// elsewhere, 4-bit decode everywhere). All sum every 32-column block exactly in integers and
// differ only in the f32 order their lanes are added in.
struct Int8Blocks {
  std::vector<int8_t> q;          // [t, k]
  std::vector<float> scale, sum;  // [t, k / 32]: the block's scale and the sum of its codes
  // k a multiple of 32. False (and unusable: the exact path runs) when x has a NaN or inf.
  bool Prepare(const float* x, int64_t t, int64_t k);
};

// The opt-in kernel for 8-bit codes against x rounded to int8 on AVX-512 VNNI
// (linear_q8_int8x.cc), on the weights WholeBlockRuns. x as that kernel reads it: Int8Blocks'
// codes, and per dword lane (4 columns) the sum of its codes and its block's scale.
struct Int8X8 {
  Int8Blocks blocks;
  std::vector<float> lane_sum, lane_scale;  // [t, k / 4]
  // False (and unusable: the exact kernel runs) when k is not a multiple of 64 or x has a NaN
  // or inf.
  bool Prepare(const float* x, int64_t t, int64_t k);
};
void SmallQ8Int8X(const SmallArgs& a, const Int8X8& x, int64_t n0, int64_t n1);

// 8- and 4-bit codes as the AVX2 kernels read them (linear_panels.cc): exact decode, and where
// PrepareCpuWeight kept the codes only here, exact prefill's f32 rows; and the int8-activation
// kernels at every T (linear_int8_panels.cc). llama.cpp's Q4_0 "8x8" interleave,
// for our runs and for 8-bit codes too. Rows are taken 8 at a time (a panel; rows past N are
// zero codes with zero constants); per panel and 32-column block, vectors of 32 bytes (4 for
// 4-bit codes, 8 for 8-bit), vector j's dword lane r holding row r's code bytes [4j, 4j + 4) of
// the block: 4-bit, columns 8j to 8j + 7 (even ones in the low nibbles); 8-bit, columns 4j to
// 4j + 3. So one instruction reaches a column (or 4, vpmaddubsw against a broadcast dword of
// x) of all 8 rows at once and a block's sums end in one lane per row: the weight's per-run
// constants then apply to 8 rows in one vector, where the row-at-a-time kernels spread each row
// over lanes and widened its constants per lane.
struct CodePanels {
  int bits = 4;
  int64_t panels = 0, blocks = 0, runs = 0;
  std::vector<uint8_t> codes;      // [panels, blocks, 32 * bits / 8 / 4 vectors, 8, 4]
  std::vector<int32_t> block_run;  // [blocks]: each block's run (WholeBlockRuns)
  std::vector<uint16_t> scale_h;   // compact weights: [panels, runs, 8] f16 scales
  std::vector<uint8_t> zero_b;     //   and byte zeros
  std::vector<float> scale, zero;  // others: [panels, runs, 8] f32
  bool compact() const { return !scale_h.empty(); }
  int64_t block_bytes() const { return 32 * bits; }  // 8 rows x 32 columns
};
// The 8 rows' scale and zero of block b of a panel (`kCompact`: p.compact()).
template <bool kCompact>
TGIS_AVX2 inline __attribute__((always_inline)) void PanelRunConstants(const CodePanels& p,
                                                                       int64_t panel, int64_t b,
                                                                       __m256* ws, __m256* wz) {
  const int64_t at = (panel * p.runs + p.block_run[b]) * 8;
  if constexpr (kCompact) {
    *ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p.scale_h[at])));
    *wz = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&p.zero_b[at]))));
  } else {
    *ws = _mm256_loadu_ps(&p.scale[at]);
    *wz = _mm256_loadu_ps(&p.zero[at]);
  }
}
// The weight's panels (made on the first call, kept with it), or null where no kernel takes
// them: codes other than 8- and 4-bit integers, runs not whole 32-column blocks, a CPU without
// AVX2.
const CodePanels* CodePanelsOf(const QuantizedWeight& q);
// Bytes held by all weights' panels now.
size_t PanelBytes();
// out = x @ w^T (+ bias) for any T, x as Int8Blocks rounds it, on the thread pool, from 8- or
// 4-bit panels (linear_int8_panels.cc); `vnni`: the CPU has AVX-512 VNNI and may use it (the
// same result).
void Int8PanelsLinear(const SmallArgs& a, const Int8Blocks& x, const CodePanels& p, bool vnni);
// out = x @ w^T (+ bias) for T <= kSmallT with x in f32: the exact decode of 8- and 4-bit codes
// on AVX2, on the thread pool; `avx512` (the CPU has it and may use it): two panels a 16-lane
// vector, the same bits.
void PanelsExactLinear(const SmallArgs& a, const CodePanels& p, bool avx512);
// Rows [n0, n0 + rows) of the weight as f32 [rows, k] (its stored columns) into dst, from the
// panels: (code - zero) * scale, rounded once, as Dequantize and the row kernels compute them.
// For exact prefill of weights whose codes are kept only in the panels.
void PanelRowsF32(const CodePanels& p, int64_t n0, int64_t rows, float* dst);

// Integer adds through asm: GCC 12 reassociates fully unrolled integer sums into trees and
// spills every product to the stack (2-3x slower); these keep each token's sum one chain.
TGIS_AVX2 inline __m256i AddI16(__m256i a, __m256i b) {
  asm("vpaddw %1, %0, %0" : "+x"(a) : "x"(b));
  return a;
}
TGIS_AVX2 inline __m256i AddI32(__m256i a, __m256i b) {
  asm("vpaddd %1, %0, %0" : "+x"(a) : "x"(b));
  return a;
}
// Four int8 codes at p, in every dword.
TGIS_AVX2 inline __m256i Broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}
// An int8 GEMM's panel of 8 output rows [n0, n0 + 8) for tokens [t0, t0 + tt): acc[t] plus the
// bias, the rows past N left out.
TGIS_AVX2 inline void StorePanel8(const SmallArgs& a, int64_t n0, int64_t t0, int tt,
                                  const __m256* acc) {
  const int rows = static_cast<int>(std::min<int64_t>(8, a.n - n0));
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 bias = a.bias ? _mm256_maskload_ps(a.bias + n0, mask) : _mm256_setzero_ps();
  for (int t = 0; t < tt; ++t)
    _mm256_maskstore_ps(a.out + (t0 + t) * a.n + n0, mask, _mm256_add_ps(acc[t], bias));
}
// The kernels that take two panels a 16-lane vector (lanes 0-7 panel's rows, 8-15 the next
// one's: linear_panels.cc, linear_int8_panels_body.h) are compiled for at least this.
#define TGIS_PANEL_PAIRS __attribute__((target("avx512f,avx512dq,avx2,fma,f16c")))
// PanelRunConstants of panels panel and panel + 1 in one vector each.
template <bool kCompact>
TGIS_PANEL_PAIRS inline __attribute__((always_inline)) void PanelPairRunConstants(
    const CodePanels& p, int64_t panel, int64_t b, __m512* ws, __m512* wz) {
  __m256 s0, z0, s1, z1;
  PanelRunConstants<kCompact>(p, panel, b, &s0, &z0);
  PanelRunConstants<kCompact>(p, panel + 1, b, &s1, &z1);
  *ws = _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1);
  *wz = _mm512_insertf32x8(_mm512_castps256_ps512(z0), z1, 1);
}
// StorePanel8 of both panels' rows [n0, n0 + 16).
TGIS_PANEL_PAIRS inline void StorePanelPair(const SmallArgs& a, int64_t n0, int64_t t0, int tt,
                                            const __m512* acc) {
  __m256 lo[kSmallT], hi[kSmallT];
  for (int t = 0; t < tt; ++t) {
    lo[t] = _mm512_castps512_ps256(acc[t]);
    hi[t] = _mm512_extractf32x8_ps(acc[t], 1);
  }
  StorePanel8(a, n0, t0, tt, lo);
  StorePanel8(a, n0 + 8, t0, tt, hi);
}

// The AVX-512 prefill GEMM (T > kSmallT; linear_gemm_avx512.cc) for every weight format: it
// asks `rows_of` for weight rows [n0, n0 + rows) as f32 [rows, K], written into `scratch`
// (room for 32 rows) or found elsewhere (f32 weights: the weight itself), and returns where
// they are. It runs on the thread pool; the bias is the caller's.
using PanelRows = std::function<const float*(int64_t n0, int rows, float* scratch)>;
void LargeAvx512Gemm(const SmallArgs& a, const PanelRows& rows_of);
// What the bf16-dot kernels (linear_gemm_bf16.cc, linear_decode_bf16.cc) are compiled for.
#define TGIS_AVX512_BF16 \
  __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")))
// The prefill GEMM for bf16 weights on AVX512_BF16 (linear_gemm_bf16.cc): x rounded to bf16,
// pairs of columns multiplied with vdpbf16ps. k must be even (Bf16DotTakes); no bias.
bool CpuHasAvx512Bf16();
void LargeBf16DotGemm(const SmallArgs& a);
// k f32 values as k bf16 values, rounded to nearest even (NaN stays NaN), in order (AVX512_BF16
// callers only).
void RowToBf16(const float* src, int64_t k, uint16_t* dst);
// The streaming kernel for bf16 weights on AVX512_BF16 (linear_decode_bf16.cc), x rounded to
// bf16 as the GEMM rounds it: every output row, grain_tiles tiles of 4 rows per parallel chunk.
void SmallBf16Dot(const SmallArgs& a, int64_t grain_tiles);
// The GEMMs' register tile of MR tokens x 32 rows of f32 sums (a token's 32 in two vectors):
// started at zero (`first`) or from out, stored back to out; only the rows in m0/m1 (the
// panel's first and second 16) are read and written.
#define TGIS_GEMM_TILE __attribute__((target("avx512f,avx512vl,avx512dq"), always_inline))
template <int MR>
TGIS_GEMM_TILE inline void StartTile(__m512 (&acc)[MR][2], const float* out, int64_t ldo,
                                     __mmask16 m0, __mmask16 m1, bool first) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    if (first) {
      acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    } else {
      acc[i][0] = _mm512_maskz_loadu_ps(m0, out + i * ldo);
      acc[i][1] = _mm512_maskz_loadu_ps(m1, out + i * ldo + 16);
    }
  }
}
template <int MR>
TGIS_GEMM_TILE inline void StoreTile(const __m512 (&acc)[MR][2], float* out, int64_t ldo,
                                     __mmask16 m0, __mmask16 m1) {
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(out + i * ldo, m0, acc[i][0]);
    _mm512_mask_storeu_ps(out + i * ldo + 16, m1, acc[i][1]);
  }
}
// dst[c * ldd + r] = src[r * ld + c] for a 16 x 16 block of 32-bit values, in four rounds of
// shuffles (AVX-512 callers only).
#if defined(__GNUC__) && !defined(__clang__)  // GCC 12's own intrinsics' undefined operands
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
__attribute__((target("avx512f"))) inline void Transpose16(const float* src, int64_t ld, float* dst,
                                                           int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  // Per 128-bit lane L (columns 4L to 4L + 3): pairs of rows interleaved, then t[4i + c] ...
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // ... r[4i + c]'s lane L holds rows 4i to 4i + 3 of column 4L + c.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // Lanes regrouped: t[c] holds columns c and c + 8 of rows 0-7, t[4 + c] columns c + 4 and
  // c + 12; t[8 + c] and t[12 + c] the same of rows 8-15.
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));
    _mm512_storeu_ps(dst + (c + 8) * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD));
    _mm512_storeu_ps(dst + (c + 4) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88));
    _mm512_storeu_ps(dst + (c + 12) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD));
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The opt-in prefill GEMM (T > kSmallT) for 8- and 4-bit codes against x as Int8Blocks rounds it
// on AVX-512 VNNI (linear_int8_gemm.cc), on the weights WholeBlockRuns; it runs on the thread
// pool and adds the bias. False (nothing written: the exact path runs) when x has a NaN or inf.
template <WFmt W>
bool LargeInt8Gemm(const SmallArgs& a);

}  // namespace tgis::kernels::cpu

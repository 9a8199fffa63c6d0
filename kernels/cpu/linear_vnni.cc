// Linear's streaming kernel for 8-bit integer codes with AVX-512 VNNI: integer dot products
// instead of dequantizing every weight to f32. (4-bit codes stay on linear_avx512.cc's permute
// table, which measured faster than widening them for these instructions.)
//
// Why not llama.cpp's way (x rounded to int8 per 32 columns): that is an activation error of
// up to 0.4% per element, and our reference is transformers in f32 on the dequantized weights
// (logprobs within 1e-4). Here each token's x is fixed point with 31 bits: q = round(x / 2^e)
// with |q| < 2^30 and 2^e the smallest power of two that allows it, so every element within a
// factor 64 of the row's largest is exact and the others keep an absolute error of 2^(e-1)
// (~1e-9 of the largest). q is split into int16 halves, q = hi * 2^15 + lo (lo in [0, 2^15)),
// and vpdpwssd sums (code - zero) * hi and (code - zero) * lo exactly in int32 lanes, 32
// columns at a time, both operands signed 16-bit (codes minus their integer zero point are
// exact there, so no cancellation against a zero-point correction).
//
// The integer sums end at each "segment" (a run's columns, at most kSegment of them, so that
// no lane can overflow): f = hi_sum * 2^15 + lo_sum in f32, acc += f * scale; the output is
// 2^e * (sum of acc's lanes) + bias. Integer addition is exact, so how columns are grouped
// for the instruction does not matter; the f32 steps happen per segment in a fixed order,
// whatever T or the batch: a row's result is batch invariant, as on the other paths.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = kAvx512Block;  // columns per instruction: 32 int16 lanes
constexpr int64_t kSegment = 2048;        // |sum| < 64 * 2 * 256 * 2^15 = 2^30 per lane
constexpr int kRows = 4;                  // weight rows per tile (T > 1)

// acc += pairwise products of a and b (int16) summed into int32 lanes: vpdpwssd. Through asm
// because GCC 12 allocates the intrinsic's tied accumulator badly (a copy and a stack store
// per instruction), which halved the kernel's speed.
TGIS_VNNI inline __m512i DotAdd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// 32 codes of the block at column k minus the run's zero, as int16 lanes.
TGIS_VNNI inline __m512i Codes32(const uint8_t* p, int64_t k, __m512i zero) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(bytes), zero);
}

// Adds segment `s` of rows [n, n + R) against x rows [t0, t0 + TT) to acc ([R][T] vectors).
// Inlined into the segment loop: a call per segment costs as much as a short run's sums.
template <int R, int TT, WFmt W>
TGIS_VNNI inline __attribute__((always_inline)) void Segment(const SmallArgs& a,
                                                             const FixedPointX& fx,
                                                             const FixedPointX::Seg& s,
                                                             const WRow* rows, int64_t t0,
                                                             __m512* acc) {
  __m512i zero[R], hi[R][TT], lo[R][TT];
  for (int r = 0; r < R; ++r) {
    zero[r] = _mm512_set1_epi16(static_cast<int16_t>(rows[r].zero[s.run]));
    for (int t = 0; t < TT; ++t) {
      hi[r][t] = _mm512_setzero_si512();
      lo[r][t] = _mm512_setzero_si512();
    }
  }
  const int16_t* xhi = fx.hi.data() + t0 * a.k;
  const int16_t* xlo = fx.lo.data() + t0 * a.k;
  // Bytes ahead: a tile of one row is one sequential stream, fetched a fixed distance on
  // (across row ends); taller tiles fetch the same column of the rows two tiles on.
  const int64_t ahead = R == 1 ? kCodesAhead : 2 * kRows * a.k;
  for (int64_t k = s.k0; k < s.k1; k += kBlock) {
    __m512i xh[TT], xl[TT];
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      xh[t] = _mm512_loadu_si512(xhi + t * a.k + k);
      xl[t] = _mm512_loadu_si512(xlo + t * a.k + k);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // Rows are short streams (a few KB) that the hardware prefetcher picks up late.
      _mm_prefetch(reinterpret_cast<const char*>(rows[r].codes() + k + ahead), _MM_HINT_T0);
      const __m512i w = Codes32(rows[r].codes(), k, zero[r]);
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) {
        hi[r][t] = DotAdd(hi[r][t], w, xh[t]);
        lo[r][t] = DotAdd(lo[r][t], w, xl[t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(rows[r].scale[s.run]);
    for (int t = 0; t < TT; ++t) {
      const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r][t]), _mm512_set1_ps(32768.f),
                                       _mm512_cvtepi32_ps(lo[r][t]));
      __m512& dst = acc[r * a.t + t0 + t];
      dst = _mm512_fmadd_ps(f, scale, dst);
    }
  }
}

// Rows [n, n + R) against x rows [t0, t0 + TT), every segment in order.
template <int R, int TT, WFmt W>
TGIS_VNNI void Dots(const SmallArgs& a, const FixedPointX& fx, int64_t n, int64_t t0, __m512* acc) {
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<W>(a, n + r);
  for (const FixedPointX::Seg& s : fx.segments) Segment<R, TT, W>(a, fx, s, rows, t0, acc);
}

template <int R, WFmt W>
TGIS_VNNI void Tile(const SmallArgs& a, const FixedPointX& fx, int64_t n) {
  const int64_t t_count = a.t;
  alignas(64) __m512 acc[R * kSmallT];
  for (int64_t i = 0; i < R * t_count; ++i) acc[i] = _mm512_setzero_ps();
  int64_t t0 = 0;
  for (; t0 + 2 <= t_count; t0 += 2) Dots<R, 2, W>(a, fx, n, t0, acc);
  if (t0 < t_count) Dots<R, 1, W>(a, fx, n, t0, acc);
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < t_count; ++t) {
      float v = std::ldexp(_mm512_reduce_add_ps(acc[r * t_count + t]), fx.exponent[t]);
      if (a.bias) v += a.bias[n + r];
      a.out[t * a.n + n + r] = v;
    }
  }
}

// hi/lo of round(x * scale) (scale a power of two, |x * scale| < 2^30) for the whole multiples
// of 16 columns of x [0, k); returns how many it did. Rounds to nearest even, as nearbyint.
TGIS_VNNI int64_t SplitFixedPoint(const float* x, int64_t k, float scale, int16_t* hi,
                                  int16_t* lo) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j),
                        _mm512_cvtepi32_epi16(_mm512_srai_epi32(q, 15)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j),
                        _mm512_cvtepi32_epi16(_mm512_and_si512(q, _mm512_set1_epi32(0x7FFF))));
  }
  return j;
}

}  // namespace

bool CpuHasAvx512Vnni() {
  static const bool has = CpuHasAvx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

bool FixedPointX::Prepare(const float* x, int64_t t, int64_t k, const int32_t* block_run) {
  hi.resize(t * k);
  lo.resize(t * k);
  exponent.resize(t);
  for (int64_t i = 0; i < t; ++i) {
    const float* row = x + i * k;
    float amax = 0;
    bool finite = true;
    for (int64_t j = 0; j < k; ++j) {
      const float v = std::fabs(row[j]);
      finite &= v <= std::numeric_limits<float>::max();  // false for NaN too
      amax = std::max(amax, v);
    }
    if (!finite) return false;  // NaN or inf: the f32 path propagates them
    // The smallest e with amax / 2^e < 2^30 (any e when x is all zeros).
    const int e = amax == 0 ? 0 : std::ilogb(amax) + 1 - 30;
    exponent[i] = e;
    int64_t j = 0;
    if (-e <= 127) j = SplitFixedPoint(row, k, std::ldexp(1.f, -e), &hi[i * k], &lo[i * k]);
    for (; j < k; ++j) {  // the tail, or every column when 2^-e is beyond f32 (tiny x)
      const int32_t q = static_cast<int32_t>(std::nearbyint(std::ldexp(row[j], -e)));
      hi[i * k + j] = static_cast<int16_t>(q >> 15);  // arithmetic: floor(q / 2^15)
      lo[i * k + j] = static_cast<int16_t>(q & 0x7FFF);
    }
  }
  segments.clear();
  for (int64_t k0 = 0; k0 < k;) {
    const int32_t run = block_run[k0 / 8];
    int64_t k1 = k0 + kBlock;
    while (k1 < k && k1 - k0 < kSegment && block_run[k1 / 8] == run) k1 += kBlock;
    segments.push_back({k0, k1, run});
    k0 = k1;
  }
  return true;
}

template <WFmt W>
void SmallVnni(const SmallArgs& a, const FixedPointX& fx, int64_t n0, int64_t n1) {
  // The tile height changes which rows share a pass, never how a row is summed. At T = 1 rows
  // go one at a time, one sequential stream fetched 4096 bytes ahead: on EPYC Zen 5
  // (kernels_bench --quick --t=1 int8, alternated three times) 42-51 GB/s against 32-37 with
  // tiles of 4 (2048 and 8192 bytes ahead measured a little less). Larger T keeps tiles of 4,
  // which share each x load among 4 rows.
  int64_t n = n0;
  if (a.t == 1) {
    for (; n < n1; ++n) Tile<1, W>(a, fx, n);
    return;
  }
  for (; n + kRows <= n1; n += kRows) Tile<kRows, W>(a, fx, n);
  for (; n < n1; ++n) Tile<1, W>(a, fx, n);
}

template void SmallVnni<WFmt::kQ8>(const SmallArgs&, const FixedPointX&, int64_t, int64_t);

}  // namespace tgis::kernels::cpu

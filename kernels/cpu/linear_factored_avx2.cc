// Linear's exact streaming kernel for 8-bit codes on AVX2 (decode, T <= kSmallT), for weights
// whose runs are whole 32-column blocks (the usual group sizes and per-row scales). (4-bit codes
// take the 8-row panels: linear_panels.cc.)
//
// Per row, block and token, the scale and zero are taken out of the block's sum:
//   sum_k x[k] * (code[k] - zero) * scale  =  scale * (sum_k x[k] * code[k] - zero * sum_k x[k])
// so the inner loop only widens codes, converts them and multiplies them into x, where
// dequantizing every weight first took a subtraction and a multiply more. Per dword lane (4
// columns of the block) the sum of the products less zero times the lane's x sum is formed in
// f32, times the scale, added into the row's f32 lanes, block after block; the output is their
// sum, plus the bias. x stays f32: the result differs from transformers'
// dequantize-then-matmul by rounding only (the zero's product cancels part of the code's, so a
// few ulps of the block sum more than the dense order), and a row's result depends on its own
// x row only: the same at any T, in any batch, on any number of threads.
//
// Measured on AMD EPYC Zen 3, 2 threads, against the dequantizing kernel it replaces (old and
// new builds alternated): kernels_bench --quick --hot --t=1, 1024x2048 in cache: int8 20.3 ->
// 25 GB/s, gptq8 22.9 -> 27; engine_bench on the cpu_bench TinyLlama shape, decode:
// --quantize bitsandbytes 13.7-14.6 -> 17.4-18.0 tok/s. Still compute-bound (about 20 G
// weights/s from DRAM, 55-60% of its bandwidth; masking the code bytes in place instead of
// widening them, as the 4-bit panels do, measured the same): the per-row, per-block scaling
// and lane sums cost about as much again as the products.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;

// A block's 32 codes as four f32 vectors.
TGIS_AVX2 inline __attribute__((always_inline)) void BlockCodes(const uint8_t* codes, int64_t b,
                                                                __m256* c) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + b * kBlock + 8 * j))));
  }
}

// Runs [r0, r0 + 8) of a row's scales and zeros as f32 into scale[] and zero[] (those past the
// row's last run left as they are): one vector conversion each for 8 blocks, where a block's
// f16 scale and byte zero widened and broadcast one at a time were a quarter of the loop.
TGIS_AVX2 inline __attribute__((always_inline)) void EightRuns(const WRow& row, int64_t r0,
                                                               int64_t runs, float* scale,
                                                               float* zero) {
  if (r0 + 8 <= runs) {
    if (row.compact()) {
      _mm256_store_ps(
          scale,
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.scale_h + r0))));
      _mm256_store_ps(zero, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                reinterpret_cast<const __m128i*>(row.zero_b + r0)))));
    } else {
      _mm256_store_ps(scale, _mm256_loadu_ps(row.scale + r0));
      _mm256_store_ps(zero, _mm256_loadu_ps(row.zero + r0));
    }
    return;
  }
  for (int64_t r = r0; r < runs; ++r) {
    scale[r - r0] = row.Scale(r);
    zero[r - r0] = row.Zero(r);
  }
}

// Rows [n, n + R) against tokens [t0, t0 + TT).
template <int R, int TT>
TGIS_AVX2 void Tile(const SmallArgs& a, const FactoredX& fx, int64_t n, int64_t t0) {
  const int64_t blocks = a.k / kBlock;
  const int64_t runs = a.q->runs();
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<WFmt::kQ8>(a, n + r);
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  alignas(32) float scale[R][8], zero[R][8];
  int64_t r0 = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    // Runs are stored in increasing order, one per block at least, so 8 blocks from a group's
    // first span at most 8 runs.
    const int64_t run = block_run[b * kBlock / 8];
    if (b % 8 == 0) {
      r0 = run;
      for (int r = 0; r < R; ++r) EightRuns(rows[r], r0, runs, scale[r], zero[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      PrefetchCodesAhead(rows[r].codes() + b * kBlock);
      __m256 c[4];
      BlockCodes(rows[r].codes(), b, c);
      const __m256 s = _mm256_broadcast_ss(&scale[r][run - r0]);
      const __m256 z = _mm256_broadcast_ss(&zero[r][run - r0]);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const float* x = &fx.x[(t0 + t) * a.k + b * kBlock];
        __m256 sum = _mm256_mul_ps(c[0], _mm256_loadu_ps(x));
        sum = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(x + 8), sum);
        sum = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(x + 16), sum);
        sum = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(x + 24), sum);
        const __m256 lane_sum = _mm256_loadu_ps(&fx.lane_sum[((t0 + t) * blocks + b) * 8]);
        acc[r][t] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, lane_sum, sum), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TT; ++t) {
      const float sum = HSum8(acc[r][t]);
      a.out[(t0 + t) * a.n + n + r] = a.bias ? sum + a.bias[n + r] : sum;
    }
  }
}

// Rows [n, n + R) against every token: pairs of tokens, then one.
template <int R>
TGIS_AVX2 void Rows(const SmallArgs& a, const FactoredX& fx, int64_t n) {
  int64_t t0 = 0;
  for (; t0 + 2 <= a.t; t0 += 2) Tile<R, 2>(a, fx, n, t0);
  if (t0 < a.t) Tile<R, 1>(a, fx, n, t0);
}

}  // namespace

void FactoredX::Prepare(const float* xs, int64_t t, int64_t k) {
  const int64_t blocks = k / kBlock;
  x.assign(xs, xs + t * k);
  lane_sum.resize(t * blocks * 8);
  for (int64_t i = 0; i < t * blocks; ++i) {
    // Lane l's x sum: its column in each of the four vectors, in order.
    const float* src = xs + i * kBlock;
    __m256 s = _mm256_loadu_ps(src);
    for (int j = 1; j < 4; ++j) s = _mm256_add_ps(s, _mm256_loadu_ps(src + 8 * j));
    _mm256_storeu_ps(&lane_sum[i * 8], s);
  }
}

void SmallFactoredAvx2(const SmallArgs& a, const FactoredX& fx, int64_t n0, int64_t n1) {
  // Tiles of 4 rows share each x load; the tile height changes which rows share a pass, never
  // how a row is summed.
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Rows<4>(a, fx, n);
  for (; n < n1; ++n) Rows<1>(a, fx, n);
}

}  // namespace tgis::kernels::cpu

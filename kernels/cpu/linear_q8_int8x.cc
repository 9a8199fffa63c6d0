// Linear's opt-in streaming kernel for 8-bit codes with x rounded to int8 (SetInt8Activations;
// the shard's --cpu-int8-activations) on AVX-512 VNNI: the decode half of the mode whose
// prefill half is linear_int8_gemm.cc, and the way llama.cpp's Q8_0 and CTranslate2's int8
// decode. (Without VNNI, the panels' kernel: linear_int8_panels.cc.)
//
// Why: the exact 8-bit kernels need two vpdpwssd per 32 weights and a widening; where 512-bit
// operations run on 256-bit units (Zen 4) that leaves them short of the memory's pace.
//
// One vpdpbusd takes 64 codes (unsigned bytes) against 64 of x's int8 codes (Int8Blocks), each
// dword lane the 4 products of 4 consecutive columns; lane l of a 64-column chunk lies in block
// l / 8. Per lane, (I - zero * sum of its 4 x codes) is exact in f32 (integers below 2^24) and
// is added, times the weight's and x's scales, into 16 f32 lanes per output; the output is
// their sum, plus the bias. A row's result depends only on its own x row: the same at any T up
// to kSmallT, in any batch, on any number of threads. Rows go one at a time (see SmallQ8Int8X).
#include <immintrin.h>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kChunk = 64;  // columns per step: 64 code bytes, 16 dword lanes

// acc += u8 a times s8 b, 4 products per int32 lane (asm: see linear_vnni.cc's DotAdd).
TGIS_VNNI inline __m512i DotAdd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The row's value for the chunk's two blocks' runs: lanes 0-7 the first's, 8-15 the second's.
TGIS_VNNI inline __m512 TwoRuns(const float* values, int32_t run0, int32_t run1) {
  const __m512 first = _mm512_set1_ps(values[run0]);
  return run0 == run1 ? first : _mm512_mask_blend_ps(0xFF00, first, _mm512_set1_ps(values[run1]));
}

// Row n against x rows [t0, t0 + TT): acc[t0 + t] gets each token's 16 lane sums.
template <int TT>
TGIS_VNNI void Dots(const SmallArgs& a, const Int8X8& x, int64_t n, int64_t t0, __m512* acc) {
  const WRow row = RowOf<WFmt::kQ8>(a, n);
  const int64_t chunks = a.k / kChunk;
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  __m512 sum[TT];
  for (int t = 0; t < TT; ++t) sum[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int32_t run0 = block_run[c * kChunk / 8], run1 = block_run[c * kChunk / 8 + 4];
    PrefetchCodesAhead(row.codes() + c * kChunk);
    const __m512i codes = _mm512_loadu_si512(row.codes() + c * kChunk);
    const __m512 w_scale = TwoRuns(row.scale, run0, run1);
    const __m512 w_zero = TwoRuns(row.zero, run0, run1);
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      const int64_t at = (t0 + t) * a.k + c * kChunk;  // x's column
      const __m512i dot =
          DotAdd(_mm512_setzero_si512(), codes, _mm512_loadu_si512(&x.blocks.q[at]));
      const __m512 exact =
          _mm512_fnmadd_ps(w_zero, _mm512_loadu_ps(&x.lane_sum[at / 4]), _mm512_cvtepi32_ps(dot));
      sum[t] = _mm512_fmadd_ps(
          exact, _mm512_mul_ps(w_scale, _mm512_loadu_ps(&x.lane_scale[at / 4])), sum[t]);
    }
  }
  for (int t = 0; t < TT; ++t) acc[t0 + t] = sum[t];
}

TGIS_VNNI void Row(const SmallArgs& a, const Int8X8& x, int64_t n) {
  alignas(64) __m512 acc[kSmallT];
  int64_t t0 = 0;
  for (; t0 + 2 <= a.t; t0 += 2) Dots<2>(a, x, n, t0, acc);
  if (t0 < a.t) Dots<1>(a, x, n, t0, acc);
  float sums[kSmallT];
  for (int64_t t = 0; t < a.t; ++t) sums[t] = _mm512_reduce_add_ps(acc[t]);
  StoreRow(a, n, sums);
}

}  // namespace

bool Int8X8::Prepare(const float* x, int64_t t, int64_t k) {
  if (k % kChunk != 0 || !blocks.Prepare(x, t, k)) return false;
  lane_sum.resize(t * k / 4);
  lane_scale.resize(t * k / 4);
  for (int64_t i = 0; i < t * k / 4; ++i) {
    const int8_t* q = &blocks.q[4 * i];
    lane_sum[i] = static_cast<float>(q[0] + q[1] + q[2] + q[3]);
    lane_scale[i] = blocks.scale[i / 8];  // 8 lanes of 4 columns per 32-column block
  }
  return true;
}

void SmallQ8Int8X(const SmallArgs& a, const Int8X8& x, int64_t n0, int64_t n1) {
  // One row after another: the weight is then one sequential stream, which the hardware
  // prefetcher serves best. Measured on Zen 4 (kernels_bench --t=1 --int8-activations int8,
  // 2 threads): 30-32 GB/s, against 21-26 with tiles of 4 rows and software prefetch (the
  // exact 8-bit kernel's way) and 16-25 with tiles of 4 and no prefetch.
  for (int64_t n = n0; n < n1; ++n) Row(a, x, n);
}

}  // namespace tgis::kernels::cpu

// Decode (T <= 2) of 4-bit codes that index a table (bitsandbytes' nf4 and fp4) with AVX2:
// per row and 32-column block, the table times the block's scale (two multiplies), then per 8
// codes two permutes pick from the table's halves and a blend on each code's bit 3 chooses:
// table[code] * scale, the product Dequantize rounds, one FMA per 8 weights and token. Each
// (row, token) sums its columns in order in one 8-lane accumulator, as the dense f32 kernel
// does, so the result is bitwise Linear on the dequantized weight. The generic AVX2 tile kept
// its accumulators on the stack for these weights (4-7x slower); this one is straight-line.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

// Run r's scale of a row (f32, or f16 for a compact weight).
template <bool kCompact>
TGIS_AVX2 inline float RunScaleOf(const WRow& row, int32_t r) {
  if constexpr (kCompact) {
    return _cvtsh_ss(row.scale_h[r]);
  } else {
    return row.scale[r];
  }
}

// Rows [n, n + R) against TT tokens.
template <int R, int TT, bool kCompact>
TGIS_AVX2 void LutTile(const SmallArgs& a, int64_t n) {
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<WFmt::kLut4>(a, n + r);
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  const __m256 low = _mm256_loadu_ps(a.q->codebook.data());
  const __m256 high = _mm256_loadu_ps(a.q->codebook.data() + 8);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  for (int64_t k = 0; k < a.k; k += 32) {
    const int32_t run = block_run[k / 8];  // the whole block's (WholeBlockRuns)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(RunScaleOf<kCompact>(rows[r], run));
      const __m256 scaled_low = _mm256_mul_ps(low, scale);
      const __m256 scaled_high = _mm256_mul_ps(high, scale);
      const uint8_t* codes = rows[r].codes() + k / 2;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        uint32_t packed;
        std::memcpy(&packed, codes + 4 * j, 4);
        // Codes8's higher bits are shifted out by the blend's shift and ignored by the
        // permutes (they read 3 bits), so no mask.
        const __m256i code = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)), shifts);
        const __m256 w = _mm256_blendv_ps(_mm256_permutevar8x32_ps(scaled_low, code),
                                          _mm256_permutevar8x32_ps(scaled_high, code),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
#pragma GCC unroll 2
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.x + t * a.k + k + 8 * j), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TT; ++t) {
      const float s = HSum8(acc[r][t]);
      a.out[t * a.n + n + r] = a.bias ? s + a.bias[n + r] : s;
    }
  }
}

template <int TT, bool kCompact>
void LutRows(const SmallArgs& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) LutTile<4, TT, kCompact>(a, n);
  for (; n < n1; ++n) LutTile<1, TT, kCompact>(a, n);
}

}  // namespace

bool LutDecodeAvx2(const SmallArgs& a, int64_t n0, int64_t n1) {
  if (a.t > 2 || !WholeBlockRuns(a.q)) return false;
  const bool compact = a.q->compact();
  if (a.t == 1) {
    compact ? LutRows<1, true>(a, n0, n1) : LutRows<1, false>(a, n0, n1);
  } else {
    compact ? LutRows<2, true>(a, n0, n1) : LutRows<2, false>(a, n0, n1);
  }
  return true;
}

}  // namespace tgis::kernels::cpu

// Decode (T <= kSmallT) of 4-bit codes that index a table (bitsandbytes' nf4 and fp4, MXFP4)
// with AVX2, on CPUs without AVX-512 (those take linear_avx512.cc's permute). The table's 16 f32
// values are kept as four byte planes, one per byte of the f32, and 32 codes at a time look up each
// plane with one vpshufb (16 entries per 128-bit lane) and are interleaved back into f32: 4
// shuffles and 8 unpacks per 32 weights, where two vpermps and a blend per 8 took 2.8 against 1.9
// cycles per 8 weights (a microbenchmark on Zen 3). Times the 32-column block's scale:
// table[code] * scale, the product Dequantize rounds.
//
// The unpacking leaves each 8 columns in the order 0 2 4 6 1 3 5 7, and x is reordered so
// (LutOrderX). Each (row, token) sums its columns in that order in one 8-lane accumulator,
// whatever T is (T <= 2 from registers, more through an f32 scratch of the rows): a row's
// result does not depend on its batch mates.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // columns of each 8, as the kernel has them
constexpr int64_t kLutChunk = 512;                   // columns per scratch pass (T > 2)

// The table's byte planes, each 16 entries repeated in both 128-bit lanes.
struct Planes {
  __m256i byte[4];
};

TGIS_AVX2 Planes PlanesOf(const std::vector<float>& table) {
  alignas(32) uint8_t planes[4][32];
  for (int v = 0; v < 16; ++v) {
    uint32_t bits;
    std::memcpy(&bits, &table[v], 4);
    for (int b = 0; b < 4; ++b) planes[b][v] = planes[b][v + 16] = (bits >> (8 * b)) & 0xFF;
  }
  Planes p;
  for (int b = 0; b < 4; ++b) p.byte[b] = _mm256_load_si256(reinterpret_cast<__m256i*>(planes[b]));
  return p;
}

// The 32 weights of a row's codes at `codes` (16 bytes: columns 2j low nibble, 2j + 1 high),
// times `scale`, in kOrder within each 8.
TGIS_AVX2 inline __attribute__((always_inline)) void Lookup32(const Planes& p, const uint8_t* codes,
                                                              __m256 scale, __m256* w) {
  // Lane 0 the even columns' codes (low nibbles), lane 1 the odd ones' (high nibbles).
  const __m256i packed =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i code = _mm256_and_si256(
      _mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
  const __m256i b0 = _mm256_shuffle_epi8(p.byte[0], code);
  const __m256i b1 = _mm256_shuffle_epi8(p.byte[1], code);
  const __m256i b2 = _mm256_shuffle_epi8(p.byte[2], code);
  const __m256i b3 = _mm256_shuffle_epi8(p.byte[3], code);
  const __m256i low01 = _mm256_unpacklo_epi8(b0, b1), high01 = _mm256_unpackhi_epi8(b0, b1);
  const __m256i low23 = _mm256_unpacklo_epi8(b2, b3), high23 = _mm256_unpackhi_epi8(b2, b3);
  w[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(low01, low23)), scale);
  w[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(low01, low23)), scale);
  w[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(high01, high23)), scale);
  w[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(high01, high23)), scale);
}

template <bool kCompact>
TGIS_AVX2 inline __m256 RunScaleOf(const WRow& row, int32_t r) {
  if constexpr (kCompact) {
    return _mm256_set1_ps(_cvtsh_ss(row.scale_h[r]));
  } else {
    return _mm256_set1_ps(row.scale[r]);
  }
}

// out[t, n + r] for rows [n, n + R) and TT tokens, lookups in registers.
template <int R, int TT, bool kCompact>
TGIS_AVX2 void LutTile(const SmallArgs& a, const Planes& p, int64_t n) {
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<WFmt::kLut4>(a, n + r);
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  for (int64_t k = 0; k < a.k; k += 32) {
    const int32_t run = block_run[k / 8];  // the whole block's (WholeBlockRuns)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 w[4];
      Lookup32(p, rows[r].codes() + k / 2, RunScaleOf<kCompact>(rows[r], run), w);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 2
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(a.x + t * a.k + k + 8 * j), acc[r][t]);
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

// acc[t] += w . x[t] over `len` columns (8 at a time, in order) for TT tokens of x (row stride
// ldx).
template <int TT>
TGIS_AVX2 inline void ScratchFma(const float* w, const float* x, int64_t ldx, int64_t len,
                                 __m256* acc) {
  __m256 a[TT];
  for (int t = 0; t < TT; ++t) a[t] = acc[t];
  for (int64_t k = 0; k < len; k += 8) {
    const __m256 wv = _mm256_load_ps(w + k);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) a[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * ldx + k), a[t]);
  }
  for (int t = 0; t < TT; ++t) acc[t] = a[t];
}

// The same for any T: rows [n, n + R) looked up once per chunk of columns into an f32 scratch,
// then every token's FMAs in the same order as LutTile's.
template <int R, bool kCompact>
TGIS_AVX2 void LutScratchTile(const SmallArgs& a, const Planes& p, int64_t n) {
  alignas(32) __m256 acc[R * kSmallT];
  for (int64_t i = 0; i < R * a.t; ++i) acc[i] = _mm256_setzero_ps();
  alignas(32) static thread_local float scratch[R][kLutChunk];
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<WFmt::kLut4>(a, n + r);
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  for (int64_t c0 = 0; c0 < a.k; c0 += kLutChunk) {
    const int64_t len = std::min(kLutChunk, a.k - c0);
    for (int r = 0; r < R; ++r) {
      for (int64_t k = 0; k < len; k += 32) {
        __m256 w[4];
        Lookup32(p, rows[r].codes() + (c0 + k) / 2,
                 RunScaleOf<kCompact>(rows[r], block_run[(c0 + k) / 8]), w);
        for (int j = 0; j < 4; ++j) _mm256_store_ps(&scratch[r][k + 8 * j], w[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // Up to 8 tokens' chains at once, so that FMA latency does not bound them.
      int64_t t = 0;
      for (; t + 8 <= a.t; t += 8)
        ScratchFma<8>(scratch[r], a.x + t * a.k + c0, a.k, len, &acc[r * a.t + t]);
      for (; t + 4 <= a.t; t += 4)
        ScratchFma<4>(scratch[r], a.x + t * a.k + c0, a.k, len, &acc[r * a.t + t]);
      for (; t < a.t; ++t)
        ScratchFma<1>(scratch[r], a.x + t * a.k + c0, a.k, len, &acc[r * a.t + t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < a.t; ++t) {
      const float s = HSum8(acc[r * a.t + t]);
      a.out[t * a.n + n + r] = a.bias ? s + a.bias[n + r] : s;
    }
  }
}

template <bool kCompact>
TGIS_AVX2 void LutRows(const SmallArgs& a, int64_t n0, int64_t n1) {
  const Planes p = PlanesOf(a.q->codebook);
  int64_t n = n0;
  if (a.t == 1) {
    for (; n + 4 <= n1; n += 4) LutTile<4, 1, kCompact>(a, p, n);
    for (; n < n1; ++n) LutTile<1, 1, kCompact>(a, p, n);
  } else if (a.t == 2) {
    for (; n + 4 <= n1; n += 4) LutTile<4, 2, kCompact>(a, p, n);
    for (; n < n1; ++n) LutTile<1, 2, kCompact>(a, p, n);
  } else {
    for (; n + 4 <= n1; n += 4) LutScratchTile<4, kCompact>(a, p, n);
    for (; n < n1; ++n) LutScratchTile<1, kCompact>(a, p, n);
  }
}

}  // namespace

bool LutDecodeTakes(const SmallArgs& a) { return a.t <= kSmallT && WholeBlockRuns(a.q); }

void LutOrderX(const float* x, int64_t t, int64_t k, float* out) {
  for (int64_t i = 0; i < t * k; i += 8) {
    for (int j = 0; j < 8; ++j) out[i + j] = x[i + kOrder[j]];
  }
}

void LutDecodeAvx2(const SmallArgs& a, int64_t n0, int64_t n1) {
  a.q->compact() ? LutRows<true>(a, n0, n1) : LutRows<false>(a, n0, n1);
}

}  // namespace tgis::kernels::cpu

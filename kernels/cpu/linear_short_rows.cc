// Linear over f32 weights with short rows (a LoRA adapter's B: rank-sized rows, 8 to 64
// values). The row-dot kernels, built for long rows, pay a horizontal sum per output, which is
// most of the work when a row is a few vectors long: 4096x32 ran at 16 GB/s at T = 1 and at
// 2.5 GB/s at T = 16. Here eight outputs are one vector: a tile of eight rows is transposed
// once (8x8 blocks in registers) into columns, and each column is multiplied into every
// token's accumulator, so there is no horizontal sum and the weight is read once per call
// whatever T is.
//
// Each output is one FMA chain over the columns in order, whatever T and the ISA path (the
// scalar path uses std::fma), so a row's result does not depend on the batch.
#include "kernels/cpu/linear_short_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {
namespace {

constexpr int64_t kRows = 8;  // outputs per vector

void Scalar(const ShortRowsArgs& a, int64_t n0, int64_t n1) {
  for (int64_t t = 0; t < a.t; ++t) {
    const float* x = a.x + t * a.k;
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = a.w + n * a.k;
      float acc = 0;
      for (int64_t j = 0; j < a.k; ++j) acc = std::fma(x[j], w[j], acc);
      a.out[t * a.n + n] = a.bias != nullptr ? acc + a.bias[n] : acc;
    }
  }
}

// 8x8 transpose: rows r0..r7 in, columns out (c[j] holds column j of the eight rows).
__attribute__((target("avx2,fma"))) inline void Transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Transposes rows [r, r + 8) of w (those below n1; zeros past them and past the last column)
// into cols: cols[j] holds column j of the eight rows.
__attribute__((target("avx2,fma"))) void TransposeTile(const ShortRowsArgs& a, int64_t r,
                                                       int64_t n1, float (*cols)[kRows]) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t rows = std::clamp<int64_t>(n1 - r, 0, kRows);
  for (int64_t j = 0; j < a.k; j += kRows) {
    const int64_t width = std::min(kRows, a.k - j);
    const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width)), lanes);
    __m256 block[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      // (Masked loads and stores only at the edges: AMD runs masked stores slowly.)
      const float* src = a.w + (r + i) * a.k + j;
      block[i] = i >= rows        ? _mm256_setzero_ps()
                 : width == kRows ? _mm256_loadu_ps(src)
                                  : _mm256_maskload_ps(src, in);
    }
    Transpose8(block);
    for (int64_t i = 0; i < kRows; ++i) _mm256_store_ps(cols[j + i], block[i]);
  }
}

// G tiles of eight rows against TT tokens at a time: G * TT accumulators, independent FMA
// chains (one per output: the same chain whatever G and TT).
template <int G, int TT>
__attribute__((target("avx2,fma"))) void Avx2Tiles(const ShortRowsArgs& a, int64_t n0, int64_t n1) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float cols[G][kShortRowsMax + kRows][kRows];
  for (int64_t r = n0; r < n1; r += G * kRows) {
    alignas(32) float bias[G][kRows] = {};
    __m256i live[G];
    for (int g = 0; g < G; ++g) {
      const int64_t first = r + g * kRows;
      TransposeTile(a, first, n1, cols[g]);
      const int64_t rows = std::clamp<int64_t>(n1 - first, 0, kRows);
      live[g] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rows)), lanes);
      if (a.bias != nullptr) {
        for (int64_t i = 0; i < rows; ++i) bias[g][i] = a.bias[first + i];
      }
    }
    for (int64_t t0 = 0; t0 < a.t; t0 += TT) {
      const int64_t tokens = std::min<int64_t>(TT, a.t - t0);
      __m256 acc[G][TT];
      for (int g = 0; g < G; ++g) {
        for (int i = 0; i < TT; ++i) acc[g][i] = _mm256_setzero_ps();
      }
      const float* x = a.x + t0 * a.k;
      for (int64_t j = 0; j < a.k; ++j) {
        for (int g = 0; g < G; ++g) {
          const __m256 col = _mm256_load_ps(cols[g][j]);
          for (int i = 0; i < TT; ++i) {
            if (i < tokens) {
              acc[g][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + i * a.k + j), col, acc[g][i]);
            }
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const int64_t first = r + g * kRows;
        if (first >= n1) break;
        const __m256 b = _mm256_load_ps(bias[g]);
        for (int i = 0; i < TT && i < tokens; ++i) {
          const __m256 y = a.bias != nullptr ? _mm256_add_ps(acc[g][i], b) : acc[g][i];
          float* dst = a.out + (t0 + i) * a.n + first;
          n1 - first >= kRows ? _mm256_storeu_ps(dst, y) : _mm256_maskstore_ps(dst, live[g], y);
        }
      }
    }
  }
}

// Eight accumulators whatever T: few tokens take more tiles at once.
void Avx2(const ShortRowsArgs& a, int64_t n0, int64_t n1) {
  if (a.t >= 8) return Avx2Tiles<1, 8>(a, n0, n1);
  if (a.t >= 4) return Avx2Tiles<2, 4>(a, n0, n1);
  if (a.t >= 2) return Avx2Tiles<4, 2>(a, n0, n1);
  Avx2Tiles<8, 1>(a, n0, n1);
}

}  // namespace

bool ShortRowsTake(int64_t k) { return k > 0 && k <= kShortRowsMax; }

void ShortRowsLinear(const ShortRowsArgs& a) {
  const bool avx2 = UseAvx2Kernels();
  // Chunks of 64 rows (whole groups of tiles whatever T), ~64 KB of weights per parallel chunk.
  constexpr int64_t kChunkRows = 64;
  const int64_t chunks = (a.n + kChunkRows - 1) / kChunkRows;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kChunkRows * a.k * 4));
  ParallelFor(chunks, grain, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * kChunkRows, n1 = std::min(a.n, e * kChunkRows);
    avx2 ? Avx2(a, n0, n1) : Scalar(a, n0, n1);
  });
}

}  // namespace tgis::kernels::cpu

// Linear's prefill GEMM on AVX-512 (T > kSmallT): out[T, N] = x[T, K] @ w[N, K]^T for every
// weight format, the weight rows widened or dequantized to f32 by the caller's converter.
//
// Why our own rather than OpenBLAS sgemm: on EPYC Zen 5 OpenBLAS 0.3.21's SkylakeX sgemm ran
// at about 40% of the FMA peak on this model's shapes (kernels_bench --quick --t=512 f32:
// 209-236 GFLOP/s on 2 cores), and 16-bit and quantized weights went through a converted f32
// copy of each block before it; CTranslate2 (MKL) ran f32 prefill 1.7x faster.
//
// Blocking (BLIS's): the weight is taken kNr = 32 rows (a panel, two zmm) at a time, converted
// once, and repacked kKc columns at a time as [kKc][32] (32 KB at kKc = 256: it stays in L1 while
// every token tile reads it). x is packed once per call as tiles of kMr tokens, [K][kMr], so
// the tokens of one column are adjacent broadcasts. The register tile is kMr tokens x 32 rows:
// 24 accumulators, two weight vectors and a broadcast, 24 FMAs per column.
//
// Order: each output is one f32 FMA chain over k in column order (kc blocks in turn, stored
// to and reloaded from `out` between them, which is exact), so its value depends on its own x
// row only: the same at any T above kSmallT, in any tile, on any number of threads.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

#define TGIS_AVX512_GEMM __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))

namespace tgis::kernels::cpu {

namespace {

constexpr int kMr = 12;       // tokens per register tile
constexpr int kNr = 32;       // weight rows per panel
constexpr int64_t kKc = 256;  // columns per packed weight block

// x [t, k] as tiles of kMr tokens, each [k][kMr]; tokens past t are zeros.
void PackX(const float* x, int64_t t, int64_t k, std::vector<float>* out) {
  const int64_t tiles = (t + kMr - 1) / kMr;
  out->resize(tiles * k * kMr);
  float* p = out->data();
  ParallelFor(tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t tile = b; tile < e; ++tile) {
      float* dst = p + tile * k * kMr;
      for (int i = 0; i < kMr; ++i) {
        const int64_t token = tile * kMr + i;
        if (token < t) {
          const float* src = x + token * k;
          for (int64_t j = 0; j < k; ++j) dst[j * kMr + i] = src[j];
        } else {
          for (int64_t j = 0; j < k; ++j) dst[j * kMr + i] = 0.f;
        }
      }
    }
  });
}

// Columns [k0, k0 + kc) of the panel's rows (rows [rows, k] f32; rows past `rows` are zeros)
// as [kc][kNr]: whole 16 x 16 blocks transposed in registers (at small T this packing is a
// large part of the work), the rest one value at a time.
TGIS_AVX512_GEMM void PackPanel(const float* w, int rows, int64_t k, int64_t k0, int64_t kc,
                                float* out) {
  for (int r0 = 0; r0 < kNr; r0 += 16) {
    int64_t j = 0;
    if (r0 + 16 <= rows) {
      for (; j + 16 <= kc; j += 16) Transpose16(w + r0 * k + k0 + j, k, out + j * kNr + r0, kNr);
    }
    for (int r = r0; r < r0 + 16; ++r) {
      if (r < rows) {
        for (int64_t i = j; i < kc; ++i) out[i * kNr + r] = w[r * k + k0 + i];
      } else {
        for (int64_t i = j; i < kc; ++i) out[i * kNr + r] = 0.f;
      }
    }
  }
}

// One register tile: out[MR tokens, 32 rows] (+)= xp [kc][kMr] (its first MR tokens) @ wp
// [kc][32]. `first`: the accumulators start at zero, else from out. Only the rows in `m0`/`m1`
// (the panel's first and second 16) are read and written. A last tile of fewer than kMr
// tokens takes its own MR, so no padding is multiplied.
template <int MR>
TGIS_AVX512_GEMM void Tile(const float* xp, const float* wp, int64_t kc, float* out, int64_t ldo,
                           __mmask16 m0, __mmask16 m1, bool first) {
  __m512 acc[MR][2];
  StartTile<MR>(acc, out, ldo, m0, m1, first);
  for (int64_t j = 0; j < kc; ++j) {
    const __m512 w0 = _mm512_loadu_ps(wp + j * kNr);
    const __m512 w1 = _mm512_loadu_ps(wp + j * kNr + 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(xp[j * kMr + i]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  StoreTile<MR>(acc, out, ldo, m0, m1);
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, __mmask16, __mmask16,
                        bool);
template <int... MR>
constexpr std::array<TileFn, kMr + 1> TileTable(std::integer_sequence<int, MR...>) {
  return {nullptr, &Tile<MR + 1>...};
}
// kTiles[m]: the tile of m tokens.
constexpr std::array<TileFn, kMr + 1> kTiles = TileTable(std::make_integer_sequence<int, kMr>());

}  // namespace

void LargeAvx512Gemm(const SmallArgs& a, const PanelRows& rows_of) {
  thread_local std::vector<float> packed_x;
  PackX(a.x, a.t, a.k, &packed_x);
  const float* xp = packed_x.data();
  const int64_t tiles = (a.t + kMr - 1) / kMr;
  const int64_t panels = (a.n + kNr - 1) / kNr;
  ParallelFor(panels, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> scratch, wp;
    scratch.resize(kNr * a.k);
    wp.resize(kKc * kNr);
    for (int64_t panel = b; panel < e; ++panel) {
      const int64_t n0 = panel * kNr;
      const int rows = static_cast<int>(std::min<int64_t>(kNr, a.n - n0));
      const float* w = rows_of(n0, rows, scratch.data());
      const __mmask16 m0 = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(rows <= 16 ? 0 : (1u << (rows - 16)) - 1);
      for (int64_t k0 = 0; k0 < a.k; k0 += kKc) {
        const int64_t kc = std::min(kKc, a.k - k0);
        PackPanel(w, rows, a.k, k0, kc, wp.data());
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t t0 = tile * kMr;
          kTiles[std::min<int64_t>(kMr, a.t - t0)](xp + (tile * a.k + k0) * kMr, wp.data(), kc,
                                                   a.out + t0 * a.n + n0, a.n, m0, m1, k0 == 0);
        }
      }
    }
  });
}

}  // namespace tgis::kernels::cpu

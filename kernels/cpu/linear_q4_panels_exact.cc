// Linear's exact decode (T <= kSmallT) of 4-bit codes on AVX2, from the 8-row panels that the
// int8-activation kernel reads (Q4Panels, linear_q4_panels.cc): x stays f32.
//
// In a panel vector's dword lane r, nibble k holds row r's code for column 8j + k of the block
// (the codes' own order). Masking nibble k in place (k = 7: shifting it down) and converting
// the dword to f32 gives code * 2^(4k) exactly, for 8 rows at once; x's column was multiplied by
// 2^(-4k) once per call (exact: a power of two), so one FMA applies 8 rows' codes to it. Per 8
// weights that is a mask, a convert and an FMA, where the row-at-a-time kernel
// (linear_factored_avx2.cc) widened codes byte by byte and summed each row across lanes. The
// block's scale and zero come out of its sum as there:
//   sum_k x[k] * (code[k] - zero) * scale  =  scale * (sum_k x[k] * code[k] - zero * sum_k x[k])
// with 8 rows' constants in one vector. Each block's products go into four chains (the
// columns k % 4), added (0 + 1) + (2 + 3), then scaled into the row's lane in block order: the
// same steps for every token, so a row's result depends on its own x row only (any T, any
// batch, any number of threads), and differs from transformers' dequantize-then-matmul by
// rounding only.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 8;
constexpr int64_t kBlockBytes = 128;

// x as the kernel multiplies it: column c times 2^(-4 * (c % 8)) (c % 8 = 7: times 1, that
// nibble being shifted down rather than masked), and each block's plain sum.
struct ScaledX {
  std::vector<float> x;    // [t, k]
  std::vector<float> sum;  // [t, k / 32]

  TGIS_AVX2 void Prepare(const float* xs, int64_t t, int64_t k) {
    const int64_t blocks = k / kBlock;
    x.resize(t * k);
    sum.resize(t * blocks);
    const __m256 pow2 =
        _mm256_setr_ps(1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f);
    for (int64_t i = 0; i < t * blocks; ++i) {
      __m256 s = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(xs + i * kBlock + 8 * j);
        s = _mm256_add_ps(s, v);
        _mm256_storeu_ps(&x[i * kBlock + 8 * j], _mm256_mul_ps(v, pow2));
      }
      sum[i] = HSum8(s);
    }
  }
};

// A nibble of every dword lane as f32: code * 2^(4k) (k = 7: the code itself).
template <int K>
TGIS_AVX2 inline __attribute__((always_inline)) __m256 Nibble(__m256i v) {
  if constexpr (K == 7) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * K))));
  }
}

// Column 8j + K of P panels' vectors v into their chains K % 4, for TT tokens (x's column at
// xj + t * x_step).
template <int K, int P, int TT>
TGIS_AVX2 inline __attribute__((always_inline)) void Column(const __m256i* v, const float* xj,
                                                            int64_t x_step, __m256 (*acc)[TT][4]) {
  __m256 f[P];
  for (int i = 0; i < P; ++i) f[i] = Nibble<K>(v[i]);
  for (int t = 0; t < TT; ++t) {
    const __m256 xk = _mm256_broadcast_ss(xj + t * x_step + K);
    for (int i = 0; i < P; ++i) acc[i][t][K % 4] = _mm256_fmadd_ps(f[i], xk, acc[i][t][K % 4]);
  }
}

// Panels [panel, panel + P) against tokens [t0, t0 + TT): P * TT <= 2 keeps the 4 chains of
// each (panel, token) in registers.
template <int P, int TT, bool kCompact>
TGIS_AVX2 void Tile(const SmallArgs& a, const ScaledX& x, const Q4Panels& p, int64_t panel,
                    int64_t t0) {
  const int64_t blocks = p.blocks;
  const uint8_t* w[P];
  for (int i = 0; i < P; ++i) w[i] = &p.codes[(panel + i) * blocks * kBlockBytes];
  __m256 out[P][TT];
  for (int i = 0; i < P; ++i)
    for (int t = 0; t < TT; ++t) out[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 acc[P][TT][4];
    for (int i = 0; i < P; ++i)
      for (int t = 0; t < TT; ++t)
        for (int c = 0; c < 4; ++c) acc[i][t][c] = _mm256_setzero_ps();
    for (int i = 0; i < P; ++i) {
      PrefetchCodesAhead(w[i] + b * kBlockBytes);
      PrefetchCodesAhead(w[i] + b * kBlockBytes + 64);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i v[P];
      for (int i = 0; i < P; ++i)
        v[i] =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b * kBlockBytes + 32 * j));
      const float* xj = &x.x[(t0 * blocks + b) * kBlock + 8 * j];
      const int64_t x_step = blocks * kBlock;  // one token to the next
      Column<0, P, TT>(v, xj, x_step, acc);
      Column<1, P, TT>(v, xj, x_step, acc);
      Column<2, P, TT>(v, xj, x_step, acc);
      Column<3, P, TT>(v, xj, x_step, acc);
      Column<4, P, TT>(v, xj, x_step, acc);
      Column<5, P, TT>(v, xj, x_step, acc);
      Column<6, P, TT>(v, xj, x_step, acc);
      Column<7, P, TT>(v, xj, x_step, acc);
    }
    for (int i = 0; i < P; ++i) {
      const int64_t at = ((panel + i) * p.runs + p.block_run[b]) * kRows;
      __m256 ws, wz;
      if constexpr (kCompact) {
        ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p.scale_h[at])));
        wz = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&p.zero_b[at]))));
      } else {
        ws = _mm256_loadu_ps(&p.scale[at]);
        wz = _mm256_loadu_ps(&p.zero[at]);
      }
      for (int t = 0; t < TT; ++t) {
        const __m256 block = _mm256_add_ps(_mm256_add_ps(acc[i][t][0], acc[i][t][1]),
                                           _mm256_add_ps(acc[i][t][2], acc[i][t][3]));
        const __m256 sum = _mm256_set1_ps(x.sum[(t0 + t) * blocks + b]);
        out[i][t] = _mm256_fmadd_ps(ws, _mm256_fnmadd_ps(wz, sum, block), out[i][t]);
      }
    }
  }
  for (int i = 0; i < P; ++i) StorePanel8(a, (panel + i) * kRows, t0, TT, out[i]);
}

template <bool kCompact>
void Panels(const SmallArgs& a, const ScaledX& x, const Q4Panels& p) {
  // About 64 KB of codes per parallel chunk, in pairs of panels.
  const int64_t panel_bytes = p.blocks * kBlockBytes;
  const int64_t pairs = (p.panels + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / (panel_bytes * a.t));
  ParallelFor(pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t panel = 2 * pair;
      if (panel + 2 > p.panels) {  // the odd last panel: one token at a time
        for (int64_t t = 0; t < a.t; ++t) Tile<1, 1, kCompact>(a, x, p, panel, t);
        continue;
      }
      int64_t t0 = 0;
      // Two tokens share each panel's converted codes; one token takes two panels at once.
      for (; t0 + 2 <= a.t; t0 += 2) {
        Tile<1, 2, kCompact>(a, x, p, panel, t0);
        Tile<1, 2, kCompact>(a, x, p, panel + 1, t0);
      }
      if (t0 < a.t) Tile<2, 1, kCompact>(a, x, p, panel, t0);
    }
  });
}

// One panel's 8 rows as f32 into dst rows 0-7 (row stride `ld`): per block and 8 columns,
// the 8 rows' weights of each column, (code - zero) * scale in one vector, then transposed.
TGIS_AVX2 void PanelF32(const Q4Panels& p, int64_t panel, float* dst, int64_t ld) {
  const uint8_t* w = &p.codes[panel * p.blocks * kBlockBytes];
  const __m256 unscale[8] = {_mm256_set1_ps(1.f),      _mm256_set1_ps(0x1p-4f),
                             _mm256_set1_ps(0x1p-8f),  _mm256_set1_ps(0x1p-12f),
                             _mm256_set1_ps(0x1p-16f), _mm256_set1_ps(0x1p-20f),
                             _mm256_set1_ps(0x1p-24f), _mm256_set1_ps(1.f)};
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t at = (panel * p.runs + p.block_run[b]) * kRows;
    __m256 ws, wz;
    if (p.compact()) {
      ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p.scale_h[at])));
      wz = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&p.zero_b[at]))));
    } else {
      ws = _mm256_loadu_ps(&p.scale[at]);
      wz = _mm256_loadu_ps(&p.zero[at]);
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlockBytes + 32 * j));
      // c[k] lane r: row r's weight of column 8j + k (the code exact in f32 after the power
      // of two; code - zero exact; one rounding in the product).
      __m256 c[8];
      c[0] = Nibble<0>(v);
      c[1] = Nibble<1>(v);
      c[2] = Nibble<2>(v);
      c[3] = Nibble<3>(v);
      c[4] = Nibble<4>(v);
      c[5] = Nibble<5>(v);
      c[6] = Nibble<6>(v);
      c[7] = Nibble<7>(v);
      for (int k = 0; k < 8; ++k)
        c[k] = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(c[k], unscale[k]), wz), ws);
      // 8 x 8 transpose: t[r] lane k = c[k] lane r.
      __m256 u[8], t[8];
      for (int i = 0; i < 4; ++i) {
        u[2 * i] = _mm256_unpacklo_ps(c[2 * i], c[2 * i + 1]);
        u[2 * i + 1] = _mm256_unpackhi_ps(c[2 * i], c[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        t[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
        t[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
        t[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
        t[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ld + b * kBlock + 8 * j,
                         _mm256_permute2f128_ps(t[i], t[4 + i], 0x20));
        _mm256_storeu_ps(dst + (4 + i) * ld + b * kBlock + 8 * j,
                         _mm256_permute2f128_ps(t[i], t[4 + i], 0x31));
      }
    }
  }
}

}  // namespace

void Q4PanelRowsF32(const Q4Panels& p, int64_t n0, int64_t rows, float* dst) {
  const int64_t k = p.blocks * kBlock;
  thread_local std::vector<float> scratch;
  for (int64_t panel = n0 / kRows; panel * kRows < n0 + rows; ++panel) {
    const int64_t first = std::max(n0, panel * kRows),
                  last = std::min(n0 + rows, (panel + 1) * kRows);
    if (first == panel * kRows && last == first + kRows) {
      PanelF32(p, panel, dst + (first - n0) * k, k);
    } else {  // a panel the range cuts: all 8 rows aside, then the ones asked for
      scratch.resize(kRows * k);
      PanelF32(p, panel, scratch.data(), k);
      std::memcpy(dst + (first - n0) * k, &scratch[(first - panel * kRows) * k],
                  (last - first) * k * sizeof(float));
    }
  }
}

void Q4PanelsExactLinear(const SmallArgs& a, const Q4Panels& p) {
  thread_local ScaledX x;
  x.Prepare(a.x, a.t, a.k);
  const ScaledX* shared = &x;  // workers read the calling thread's copy
  p.compact() ? Panels<true>(a, *shared, p) : Panels<false>(a, *shared, p);
}

}  // namespace tgis::kernels::cpu

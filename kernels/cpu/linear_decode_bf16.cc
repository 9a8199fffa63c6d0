// Linear's streaming (decode, T <= kSmallT) kernel for bf16 weights on CPUs with AVX512_BF16:
// x rounded to bf16 as the prefill GEMM (linear_gemm_bf16.cc) rounds it, 32 columns of a row
// against 32 of a token per vdpbf16ps. At T = 1 it streams the weights as the f32-x kernel
// does; at 4-16 tokens (batched decode) the f32-x kernel widens every weight and runs at half
// the FMA peak, where this one multiplies the stored pairs directly.
//
// Order: each output is one chain of vdpbf16ps steps over its row's 32-column blocks (the
// last one zero-padded), then one fixed 16-lane sum, for every T, tile height and thread
// count: a row's result depends on its own x row only, as the f32-x decode kernels'.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;  // columns per vdpbf16ps
constexpr int kRows = 4;        // weight rows per tile
constexpr int kTokens = 4;      // tokens per pass over a tile's rows

// x [t, k] rounded to bf16 into rows of `width` (k rounded up to whole blocks, zeros past k).
void RoundX(const float* x, int64_t t, int64_t k, int64_t width, uint16_t* out) {
  for (int64_t i = 0; i < t; ++i) {
    RowToBf16(x + i * k, k, out + i * width);
    std::fill(out + i * width + k, out + (i + 1) * width, uint16_t{0});
  }
}

// One 32-column block of rows [0, R) against tokens [t0, t0 + TT). kTail: the row's last,
// partial block, its weights read masked (x is zero-padded).
template <int R, int TT, bool kTail>
TGIS_AVX512_BF16 __attribute__((always_inline)) inline void Block(const uint16_t* w, int64_t k,
                                                                  const uint16_t* xb, int64_t width,
                                                                  int64_t t0, int64_t c,
                                                                  __mmask32 m,
                                                                  __m512 (&acc)[R][TT]) {
  __m512bh wv[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512i v =
        kTail ? _mm512_maskz_loadu_epi16(m, w + r * k + c) : _mm512_loadu_si512(w + r * k + c);
    wv[r] = reinterpret_cast<const __m512bh&>(v);
  }
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    const __m512i v = _mm512_loadu_si512(xb + (t0 + t) * width + c);
    const __m512bh xv = reinterpret_cast<const __m512bh&>(v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
  }
}

// Rows [0, R) of w against tokens [t0, t0 + TT): every block of the rows, in order.
template <int R, int TT>
TGIS_AVX512_BF16 void Pass(const uint16_t* w, int64_t k, const uint16_t* xb, int64_t width,
                           int64_t t0, float* out, int64_t ldo, const float* bias) {
  __m512 acc[R][TT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t full = k / kBlock * kBlock;
  for (int64_t c = 0; c < full; c += kBlock) Block<R, TT, false>(w, k, xb, width, t0, c, 0, acc);
  if (full < k) {
    const auto m = static_cast<__mmask32>((1ull << (k - full)) - 1);
    Block<R, TT, true>(w, k, xb, width, t0, full, m, acc);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const float s = _mm512_reduce_add_ps(acc[r][t]);
      out[(t0 + t) * ldo + r] = bias ? s + bias[r] : s;
    }
  }
}

// Rows [n, n + R) against every token.
template <int R>
void RowTile(const SmallArgs& a, const uint16_t* xb, int64_t width, int64_t n) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n * a.k;
  float* out = a.out + n;
  const float* bias = a.bias ? a.bias + n : nullptr;
  int64_t t0 = 0;
  for (; t0 + kTokens <= a.t; t0 += kTokens)
    Pass<R, kTokens>(w, a.k, xb, width, t0, out, a.n, bias);
  for (; t0 + 2 <= a.t; t0 += 2) Pass<R, 2>(w, a.k, xb, width, t0, out, a.n, bias);
  if (t0 < a.t) Pass<R, 1>(w, a.k, xb, width, t0, out, a.n, bias);
}

}  // namespace

void SmallBf16Dot(const SmallArgs& a, int64_t grain_tiles) {
  const int64_t width = (a.k + kBlock - 1) / kBlock * kBlock;
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(a.t * width + 32);
  RoundX(a.x, a.t, a.k, width, rounded.data());
  const uint16_t* xb = rounded.data();  // workers read the calling thread's copy
  const int64_t tiles = (a.n + kRows - 1) / kRows;
  ParallelFor(tiles, grain_tiles, [&](int64_t b, int64_t e) {
    const int64_t n1 = std::min(a.n, e * kRows);
    int64_t n = b * kRows;
    // One row at a time at T = 1: one sequential stream per thread, as the f32-x kernel
    // (linear_avx512.cc) found best.
    if (a.t > 1) {
      for (; n + kRows <= n1; n += kRows) RowTile<kRows>(a, xb, width, n);
    }
    for (; n < n1; ++n) RowTile<1>(a, xb, width, n);
  });
}

}  // namespace tgis::kernels::cpu

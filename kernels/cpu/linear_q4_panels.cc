// Linear for 4-bit codes with x rounded to int8 (SetInt8Activations; the shard's
// --cpu-int8-activations) in AVX2 code, on every CPU for decode and without VNNI for prefill: the
// codes interleaved 8 rows at a time (CodePanels, made once per weight), so that decode streams
// them as llama.cpp's repacked Q4_0 streams its blocks. Per 32-column block and token: 8 vpmaddubsw
// (4 columns of 8 rows each, against a broadcast dword of x's codes; pair sums at most 2 * 15 *
// 127) summed in int16 (at most 30480), one vpmaddwd into int32, then (I - zero * sum(xq)) exactly
// in f32 (below 2^24), times the weight's and x's scales, added into the row's f32 lane in block
// order: the steps of LargeInt8Gemm's AVX2 kernel, so decode and prefill give a row the same bits.
//
// Measured on AMD EPYC Zen 3, 2 threads (kernels_bench --quick --t=1 --int8-activations
// gptq4g32): see benchmarks/README.md, session 17.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;        // columns per x scale and per weight run
constexpr int kRows = 8;              // rows per panel: one ymm of int32 or f32 lanes
constexpr int64_t kBlockBytes = 128;  // a panel's codes per block: 8 rows x 16 bytes

// x's codes as the kernel broadcasts them: per token and block, the 16 even columns' codes,
// then the 16 odd ones' (the order of the panels' low and high nibbles).
TGIS_AVX2 void SplitEvenOdd(const Int8Blocks& x, int64_t count, std::vector<int8_t>* out) {
  out->resize(count * kBlock);
  // Within each 128-bit lane: its 8 even bytes, then its 8 odd ones; then the lanes' even
  // halves first.
  const __m256i gather = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0,
                                          2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t i = 0; i < count; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[i * kBlock]));
    const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, gather), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->data() + i * kBlock), split);
  }
}

// Tokens [t0, t0 + TT) against one panel's 8 rows.
template <int TT, bool kCompact>
TGIS_AVX2 void Tile(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs, const CodePanels& p,
                    int64_t panel, int64_t t0) {
  const int64_t blocks = p.blocks;
  const uint8_t* w = &p.codes[panel * blocks * kBlockBytes];
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBlockBytes;
    PrefetchCodesAhead(wb);
    PrefetchCodesAhead(wb + 64);
    __m256i dot[TT];
    for (int t = 0; t < TT; ++t) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      const __m256i even = _mm256_and_si256(v, low);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int8_t* xb = xs + ((t0 + t) * blocks + b) * kBlock;
        dot[t] = AddI16(dot[t], _mm256_maddubs_epi16(even, Broadcast4(xb + 4 * j)));
        dot[t] = AddI16(dot[t], _mm256_maddubs_epi16(odd, Broadcast4(xb + 16 + 4 * j)));
      }
    }
    __m256 ws, wz;
    PanelRunConstants<kCompact>(p, panel, b, &ws, &wz);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const int64_t xb = (t0 + t) * blocks + b;
      const __m256 sum = _mm256_set1_ps(x.sum[xb]);
      const __m256 exact =
          _mm256_fnmadd_ps(wz, sum, _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[t], ones)));
      acc[t] = _mm256_fmadd_ps(exact, _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[xb])), acc[t]);
    }
  }
  StorePanel8(a, panel * kRows, t0, TT, acc);
}

template <bool kCompact>
void Panels(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs, const CodePanels& p) {
  // About 64 KB of codes per parallel chunk in decode; single panels when every one is a
  // GEMM's worth of work.
  const int64_t panel_bytes = p.blocks * kBlockBytes;
  const int64_t grain =
      a.t > kSmallT ? 1 : std::max<int64_t>(1, (int64_t{64} << 10) / (panel_bytes * a.t));
  ParallelFor(p.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      int64_t t0 = 0;
      for (; t0 + 4 <= a.t; t0 += 4) Tile<4, kCompact>(a, x, xs, p, panel, t0);
      if (t0 + 2 <= a.t) {
        Tile<2, kCompact>(a, x, xs, p, panel, t0);
        t0 += 2;
      }
      if (t0 < a.t) Tile<1, kCompact>(a, x, xs, p, panel, t0);
    }
  });
}

}  // namespace

void Q4PanelsLinear(const SmallArgs& a, const Int8Blocks& x, const CodePanels& p) {
  thread_local std::vector<int8_t> xs;
  SplitEvenOdd(x, a.t * p.blocks, &xs);
  const int8_t* split = xs.data();  // workers read the calling thread's copy
  p.compact() ? Panels<true>(a, x, split, p) : Panels<false>(a, x, split, p);
}

}  // namespace tgis::kernels::cpu

// Linear for 8- and 4-bit codes with x rounded to int8 (SetInt8Activations; the shard's
// --cpu-int8-activations) in AVX2 code, at every T: on every CPU for 4-bit decode, and on CPUs
// without VNNI for 8-bit decode and for prefill. The codes come interleaved 8 rows at a time
// (CodePanels, made once per weight), so that decode streams them as llama.cpp's repacked Q4_0
// streams its blocks and prefill needs no per-call repacking. One kernel for every T: a row's
// result depends on its own x row only, never on T, the token tiles or the threads.
//
// Per 32-column block, token and panel, the block's integer sum I over the 8 rows is exact in
// int32, then (I - zero * sum(xq)) is exact in f32 (below 2^24), times the weight's and x's
// scales, added into the row's f32 lane in block order. The integer sums:
//  - 4-bit: 8 vpmaddubsw (4 columns of 8 rows each, against a broadcast dword of x's codes;
//    pair sums at most 2 * 15 * 127) summed in int16 (at most 30480), one vpmaddwd into int32.
//  - 8-bit: vpmaddubsw's pair sums of code and x would saturate (2 * 255 * 127), so it takes
//    (code - 128) as its magnitude (unsigned) against x's codes carrying its sign (vpsignb):
//    pair sums at most 2 * 128 * 127, one vpmaddwd into int32 after each. That is 5 vector
//    instructions per 32 products and token, where 4-bit codes need 3, and on Zen 3 the
//    vector pipes run about 3.5 of them a cycle. Tried and slower: the codes widened to words
//    (two vpshufb per vector, shared by the tile's tokens) against x as words, one vpmaddwd
//    per 2 columns of 8 rows: a broadcast per 16 products instead of 32 (kernels_bench
//    --quick --hot --t=512 --int8-activations int8: 177 against 185 GFLOP/s).
//
// Measured on AMD EPYC Zen 3, 2 threads: see benchmarks/README.md, sessions 17 and 19.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;  // columns per x scale and per weight run
constexpr int kRows = 8;        // rows per panel: one ymm of int32 or f32 lanes

// x's codes as the 4-bit kernel broadcasts them: per token and block, the 16 even columns'
// codes, then the 16 odd ones' (the order of the panels' low and high nibbles).
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

// The 8 rows' int32 sums of one block against x's codes for tokens [t0, t0 + TT): 4-bit codes
// against SplitEvenOdd's bytes.
template <int TT>
TGIS_AVX2 inline __attribute__((always_inline)) void BlockSums4(const uint8_t* wb,
                                                                const int8_t* const* xb,
                                                                __m256i* dot) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i pairs[TT];
  for (int t = 0; t < TT; ++t) pairs[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
    const __m256i even = _mm256_and_si256(v, low);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      pairs[t] = AddI16(pairs[t], _mm256_maddubs_epi16(even, Broadcast4(xb[t] + 4 * j)));
      pairs[t] = AddI16(pairs[t], _mm256_maddubs_epi16(odd, Broadcast4(xb[t] + 16 + 4 * j)));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < TT; ++t) dot[t] = _mm256_madd_epi16(pairs[t], ones);
}

// 8-bit codes against x's codes in column order. Vector j's dword lane r holds row r's columns
// 4j to 4j + 3, multiplied as (code - 128): its magnitude (unsigned) against x's codes carrying
// its sign, so that no pair sum saturates (at most 2 * 128 * 127); 128 * sum(xq) is added back
// by the caller's zero term (exact).
template <int TT>
TGIS_AVX2 inline __attribute__((always_inline)) void BlockSums8(const uint8_t* wb,
                                                                const int8_t* const* xb,
                                                                __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < TT; ++t) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i centered =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j)),
                         _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i magnitude = _mm256_abs_epi8(centered);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const __m256i pairs =
          _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(Broadcast4(xb[t] + 4 * j), centered));
      dot[t] = AddI32(dot[t], _mm256_madd_epi16(pairs, ones));
    }
  }
}

// Tokens [t0, t0 + TT) against panels [panel, panel + P) (8 rows each), x's codes as the
// panels' bits want them. Each panel's steps are the same whatever P and TT.
template <int P, int TT, bool kCompact, int kBits>
TGIS_AVX2 void Tile(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs, const CodePanels& p,
                    int64_t panel, int64_t t0) {
  const int64_t blocks = p.blocks;
  const int64_t block_bytes = p.block_bytes();
  const uint8_t* w = &p.codes[panel * blocks * block_bytes];
  __m256 acc[P][TT];
  for (int i = 0; i < P; ++i)
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb[TT];
    for (int t = 0; t < TT; ++t) xb[t] = xs + ((t0 + t) * blocks + b) * kBlock;
#pragma GCC unroll 2
    for (int i = 0; i < P; ++i) {
      const uint8_t* wb = w + (i * blocks + b) * block_bytes;
      // Decode streams the codes from memory; a GEMM's panel stays in cache for every token
      // tile (prefetching there cost 4-7%: kernels_bench --quick --hot --t=512). On Zen 3,
      // 2048 bytes ahead did a little better than 4096 for 8-bit codes and no worse for 4-bit
      // (kernels_bench --quick --t=1 --int8-activations int8 gptq4g32, alternated).
      if (a.t <= kSmallT) {
        for (int64_t line = 0; line < block_bytes; line += 64) PrefetchCodesAhead(wb + line, 2048);
      }
      __m256i dot[TT];
      if constexpr (kBits == 4) {
        BlockSums4<TT>(wb, xb, dot);
      } else {
        BlockSums8<TT>(wb, xb, dot);
      }
      __m256 ws, wz;
      PanelRunConstants<kCompact>(p, panel + i, b, &ws, &wz);
      if constexpr (kBits == 8) wz = _mm256_sub_ps(wz, _mm256_set1_ps(128.f));  // exact
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int64_t at = (t0 + t) * blocks + b;
        const __m256 sum = _mm256_set1_ps(x.sum[at]);
        const __m256 exact = _mm256_fnmadd_ps(wz, sum, _mm256_cvtepi32_ps(dot[t]));
        acc[i][t] =
            _mm256_fmadd_ps(exact, _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[at])), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < P; ++i) StorePanel8(a, (panel + i) * kRows, t0, TT, acc[i]);
}

template <bool kCompact, int kBits>
void Panels(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs, const CodePanels& p) {
  // About 64 KB of codes per parallel chunk in decode; single panels when every one is a
  // GEMM's worth of work.
  const int64_t panel_bytes = p.blocks * p.block_bytes();
  const int64_t grain =
      a.t > kSmallT ? 1 : std::max<int64_t>(1, (int64_t{64} << 10) / (panel_bytes * a.t));
  ParallelFor(p.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end;) {
      // 8-bit codes: two panels at once where one token is left (decode's T = 1), two streams
      // of codes (Zen 3, kernels_bench --quick --t=1 --int8-activations, alternated: int8
      // 29-31 -> 32-34 GB/s; 4-bit codes lost as much that way: gptq4g32 33-37 -> 28-33).
      const int pair = kBits == 8 && panel + 2 <= end ? 2 : 1;
      for (int i = 0; i < pair; ++i) {
        int64_t t0 = 0;
        for (; t0 + 4 <= a.t; t0 += 4) Tile<1, 4, kCompact, kBits>(a, x, xs, p, panel + i, t0);
        if (t0 + 2 <= a.t) Tile<1, 2, kCompact, kBits>(a, x, xs, p, panel + i, t0);
      }
      if (a.t % 2 == 1) {
        pair == 2 ? Tile<2, 1, kCompact, kBits>(a, x, xs, p, panel, a.t - 1)
                  : Tile<1, 1, kCompact, kBits>(a, x, xs, p, panel, a.t - 1);
      }
      panel += pair;
    }
  });
}

}  // namespace

void Int8PanelsLinear(const SmallArgs& a, const Int8Blocks& x, const CodePanels& p) {
  if (p.bits == 8) {
    const int8_t* xs = x.q.data();
    return p.compact() ? Panels<true, 8>(a, x, xs, p) : Panels<false, 8>(a, x, xs, p);
  }
  thread_local std::vector<int8_t> split;
  SplitEvenOdd(x, a.t * p.blocks, &split);
  const int8_t* xs = split.data();  // workers read the calling thread's copy
  p.compact() ? Panels<true, 4>(a, x, xs, p) : Panels<false, 4>(a, x, xs, p);
}

}  // namespace tgis::kernels::cpu

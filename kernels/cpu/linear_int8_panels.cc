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
// With AVX-512 VNNI (linear_int8_panels_vnni.cc) the 4-bit sums take vpdpbusd, the same
// integers, and from T = 5 two panels go in one 16-lane vector (PairTile16: half the
// instructions where 512-bit ones run as two halves). On Zen 4 (kernels_bench --shape=5760x2880
// --int8-activations gptq4g32, 8 lanes against 16): T=6 0.573 -> 0.517 ms, T=8 0.72 -> 0.63,
// T=16 1.375 -> 1.07-1.12, T=512 (prefill) 38.5-39.7 -> 30.2-30.6. At T <= 4, where the 8-lane
// tiles already stream at the DRAM's rate, the pairs' two streams of codes were slower (T=1
// 0.29 -> 0.36, T=2 0.30 -> 0.40; T=4 even), so those keep 8 lanes.
//
// Measured on AMD EPYC Zen 3, 2 threads: see benchmarks/README.md, sessions 17 and 19.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

void Int8PanelsLinearVnni(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs,
                          const CodePanels& p);  // linear_int8_panels_vnni.cc

namespace {

#define TGIS_PANELS_TARGET TGIS_AVX2
#define TGIS_PANELS_VNNI 0
#include "kernels/cpu/linear_int8_panels_body.h"  // NOLINT(build/include): in this namespace

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

}  // namespace

void Int8PanelsLinear(const SmallArgs& a, const Int8Blocks& x, const CodePanels& p, bool vnni) {
  const int8_t* xs = x.q.data();
  thread_local std::vector<int8_t> split;
  if (p.bits == 4) {
    SplitEvenOdd(x, a.t * p.blocks, &split);
    xs = split.data();  // workers read the calling thread's copy
  }
  vnni ? Int8PanelsLinearVnni(a, x, xs, p) : RunPanels(a, x, xs, p);
}

}  // namespace tgis::kernels::cpu

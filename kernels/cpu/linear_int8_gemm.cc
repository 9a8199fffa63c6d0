// Linear's opt-in prefill GEMM for 8- and 4-bit codes with x rounded to int8 (SetInt8Activations;
// the shard's --cpu-int8-activations), on AVX-512 VNNI: CTranslate2's and llama.cpp's way of
// running a quantized checkpoint's prompt, where the exact path (codes dequantized to f32, then
// OpenBLAS sgemm) runs at f32's speed.
//
// x is rounded as the mode's decode kernels round it (Int8Blocks): per token and per 32 stored
// columns, q = nearbyint(x * (127 / absmax)), scale absmax / 127. The weights are
// taken 16 rows (a panel) at a time and repacked once per panel, for every token tile to read:
// 4 consecutive columns of the 16 rows per 64-byte vector, the codes as unsigned bytes (4-bit
// codes widened). One vpdpbusd then adds 4 columns of 16 rows for one token (64 products,
// against FMA's 16), with the token's 4 int8 codes broadcast. Per 32-column block the exact
// integer sum I (at most 32 * 255 * 127) becomes (I - zero * sum(q)) in f32 (exact: below
// 2^24) and is added, times the weight's and x's scales, into one f32 accumulator per output:
// every output sums its blocks in column order, so its value depends on its own x row only,
// never on T, the tiles or the threads.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;  // columns per x scale and per weight run
constexpr int kPanel = 16;      // weight rows per panel: one zmm of f32 outputs
constexpr int kTokens = 8;      // tokens per register tile

// acc += u8 a times s8 b, 4 products summed into each int32 lane: vpdpbusd. Through asm for
// the reason linear_vnni.cc gives (GCC 12's tied-accumulator copies).
TGIS_VNNI inline __m512i DotAdd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

TGIS_VNNI bool RoundBlocks(const float* x, int64_t t, int64_t k, Int8Blocks* out) {
  const int64_t blocks = k / kBlock;
  out->q.resize(t * k);
  out->scale.resize(t * blocks);
  out->sum.resize(t * blocks);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < t * blocks; ++i) {
    const __m512 a = _mm512_loadu_ps(x + i * kBlock);
    const __m512 b = _mm512_loadu_ps(x + i * kBlock + 16);
    // NaN: vmaxps would drop it, so it is looked for first.
    if (_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0) return false;
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    if (!(amax <= std::numeric_limits<float>::max())) return false;  // inf
    float inverse = amax == 0 ? 0.f : 127.f / amax;
    if (!(inverse <= std::numeric_limits<float>::max())) inverse = 0.f;
    const __m512 by = _mm512_set1_ps(inverse);
    // Round to nearest even, as std::nearbyint in the default mode.
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, by));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, by));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out->q[i * kBlock]), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out->q[i * kBlock + 16]),
                     _mm512_cvtsepi32_epi8(qb));
    out->scale[i] = inverse == 0 ? 0.f : amax / 127.f;
    out->sum[i] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
  return true;
}

// One panel's weights as the kernel reads them: codes [k / 4][16 rows][4 columns], and per
// block the 16 rows' scales and zeros. Rows past N are zeros with scale 0.
struct Panel {
  std::vector<uint8_t> codes;
  std::vector<float> scale, zero;  // [k / 32][16]

  template <WFmt W>
  void Pack(const SmallArgs& a, int64_t n0) {
    const int64_t blocks = a.k / kBlock;
    codes.assign(a.k * kPanel, 0);
    scale.assign(blocks * kPanel, 0.f);
    zero.assign(blocks * kPanel, 0.f);
    const int rows = static_cast<int>(std::min<int64_t>(kPanel, a.n - n0));
    for (int r = 0; r < rows; ++r) {
      const WRow row = RowOf<W>(a, n0 + r);
      const uint8_t* c = row.codes();
      for (int64_t s = 0; s < a.k / 4; ++s) {
        uint8_t* dst = &codes[(s * kPanel + r) * 4];
        if constexpr (W == WFmt::kQ8) {
          std::memcpy(dst, c + 4 * s, 4);
        } else {  // byte j holds columns 2j (low nibble) and 2j + 1
          const uint8_t lo = c[2 * s], hi = c[2 * s + 1];
          dst[0] = lo & 0xF;
          dst[1] = lo >> 4;
          dst[2] = hi & 0xF;
          dst[3] = hi >> 4;
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t run = row.block_run[b * kBlock / 8];  // one run per block (Avx512Takes)
        scale[b * kPanel + r] = row.scale[run];
        zero[b * kPanel + r] = row.zero[run];
      }
    }
  }
};

// out[t0 .. t0 + TT) of the panel's rows.
template <int TT>
TGIS_VNNI void Tile(const SmallArgs& a, const Int8Blocks& x, const Panel& p, int64_t n0,
                    int64_t t0) {
  const int64_t blocks = a.k / kBlock;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[TT];
    for (int t = 0; t < TT; ++t) dot[t] = _mm512_setzero_si512();
    const uint8_t* w = &p.codes[b * kBlock * kPanel];
    const int8_t* xq = &x.q[t0 * a.k + b * kBlock];
#pragma GCC unroll 8
    for (int s = 0; s < kBlock / 4; ++s) {
      const __m512i wv = _mm512_loadu_si512(w + s * 4 * kPanel);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        int32_t four;
        std::memcpy(&four, xq + t * a.k + 4 * s, 4);
        dot[t] = DotAdd(dot[t], wv, _mm512_set1_epi32(four));
      }
    }
    const __m512 ws = _mm512_loadu_ps(&p.scale[b * kPanel]);
    const __m512 wz = _mm512_loadu_ps(&p.zero[b * kPanel]);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const int64_t at = (t0 + t) * blocks + b;
      const __m512 exact =
          _mm512_fnmadd_ps(wz, _mm512_set1_ps(x.sum[at]), _mm512_cvtepi32_ps(dot[t]));
      acc[t] = _mm512_fmadd_ps(exact, _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[at])), acc[t]);
    }
  }
  const int rows = static_cast<int>(std::min<int64_t>(kPanel, a.n - n0));
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
  for (int t = 0; t < TT; ++t)
    _mm512_mask_storeu_ps(a.out + (t0 + t) * a.n + n0, mask, _mm512_add_ps(acc[t], bias));
}

template <WFmt W>
void Gemm(const SmallArgs& a, const Int8Blocks& x) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel;
  ParallelFor(panels, 1, [&](int64_t b, int64_t e) {
    thread_local Panel p;
    for (int64_t i = b; i < e; ++i) {
      const int64_t n0 = i * kPanel;
      p.Pack<W>(a, n0);
      int64_t t0 = 0;
      for (; t0 + kTokens <= a.t; t0 += kTokens) Tile<kTokens>(a, x, p, n0, t0);
      if (t0 + 4 <= a.t) {
        Tile<4>(a, x, p, n0, t0);
        t0 += 4;
      }
      for (; t0 < a.t; ++t0) Tile<1>(a, x, p, n0, t0);
    }
  });
}

}  // namespace

bool Int8Blocks::Prepare(const float* x, int64_t t, int64_t k) {
  return k % kBlock == 0 && RoundBlocks(x, t, k, this);
}

template <WFmt W>
bool LargeInt8Gemm(const SmallArgs& a) {
  static_assert(W == WFmt::kQ8 || W == WFmt::kQ4);
  thread_local Int8Blocks x;
  if (!x.Prepare(a.x, a.t, a.k)) return false;
  Gemm<W>(a, x);
  return true;
}

template bool LargeInt8Gemm<WFmt::kQ8>(const SmallArgs& a);
template bool LargeInt8Gemm<WFmt::kQ4>(const SmallArgs& a);

}  // namespace tgis::kernels::cpu

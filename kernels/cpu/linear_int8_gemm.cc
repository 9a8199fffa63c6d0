// Linear's opt-in prefill GEMM for 8- and 4-bit codes with x rounded to int8 (SetInt8Activations;
// the shard's --cpu-int8-activations), on AVX-512 VNNI: CTranslate2's and llama.cpp's way
// of running a quantized checkpoint's prompt, where the exact path (codes dequantized to f32, then
// the f32 GEMM) runs at f32's speed.
//
// x is rounded as the mode's decode kernels round it (Int8Blocks): per token and per 32 stored
// columns, q = nearbyint(x * (127 / absmax)), scale absmax / 127. The weights are
// taken 32 rows (a panel) at a time and repacked once per panel, for every token tile to read:
// 4 consecutive columns of 16 rows per 64-byte vector, the codes as unsigned bytes (4-bit codes
// widened). One vpdpbusd then adds 4 columns of 16 rows for one token (64 products, against
// FMA's 16), with the token's 4 int8 codes broadcast; a register tile is 6 tokens x 32 rows, so
// a broadcast serves two of them. Per 32-column block the exact
// integer sum I (at most 32 * 255 * 127) becomes (I - zero * sum(q)) in f32 (exact: below
// 2^24) and is added, times the weight's and x's scales, into one f32 accumulator per output
// (a weight with one run per row, as bitsandbytes' int8: times x's scale only, the weight's
// applied once at the end):
// every output sums its blocks in column order, so its value depends on its own x row only,
// never on T, the tiles or the threads. Without VNNI the codes' panels made once per weight
// (linear_int8_panels.cc) take every T instead.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;  // columns per x scale and per weight run
constexpr int kPanel = 32;      // VNNI: weight rows per panel, two zmm of f32 outputs
constexpr int kTokens = 6;      // VNNI: tokens per register tile (24 of the 32 zmm accumulate)

// acc += u8 a times s8 b, 4 products summed into each int32 lane: vpdpbusd. Through asm for
// the reason linear_vnni.cc gives (GCC 12's tied-accumulator copies).
TGIS_VNNI inline __m512i DotAdd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

TGIS_AVX2 bool RoundBlocks(const float* x, int64_t t, int64_t k, Int8Blocks* out) {
  const int64_t blocks = k / kBlock;
  out->q.resize(t * k);
  out->scale.resize(t * blocks);
  out->sum.resize(t * blocks);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < t * blocks; ++i) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + i * kBlock + 8 * j);
    // NaN: vmaxps would drop it, so it is looked for first.
    const __m256 unordered = _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q),
                                          _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q));
    if (_mm256_movemask_ps(unordered) != 0) return false;
    const __m256 m =
        _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (!(amax <= std::numeric_limits<float>::max())) return false;  // inf
    float inverse = amax == 0 ? 0.f : 127.f / amax;
    if (!(inverse <= std::numeric_limits<float>::max())) inverse = 0.f;
    const __m256 by = _mm256_set1_ps(inverse);
    __m256i q[4];  // rounded to nearest even, as std::nearbyint in the default mode
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], by));
    // Saturating packs work within 128-bit lanes: dword j of `packed` holds q[j % 4]'s codes
    // [4 (j / 4), 4 (j / 4) + 4); the permute puts them back in column order.
    const __m256i packed =
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(&out->q[i * kBlock]),
        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    out->scale[i] = inverse == 0 ? 0.f : amax / 127.f;
    const __m256i sum8 =
        _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
    out->sum[i] = static_cast<float>(_mm_cvtsi128_si32(sum4));
  }
  return true;
}

// One panel's weights as the kernel reads them: codes [k / 4][kPanel][4 columns], and per
// block the rows' scales and zeros. Rows past N are zeros with scale 0.
struct Panel {
  std::vector<uint8_t> codes;
  std::vector<float> scale, zero;  // [k / 32][kPanel]

  template <WFmt W>
  void Pack(const SmallArgs& a, int64_t n0) {
    const int64_t blocks = a.k / kBlock;
    codes.resize(a.k * kPanel);
    scale.resize(blocks * kPanel);
    zero.resize(blocks * kPanel);
    const int rows = static_cast<int>(std::min<int64_t>(kPanel, a.n - n0));
    if (rows < kPanel) {
      std::fill(codes.begin(), codes.end(), 0);
      std::fill(scale.begin(), scale.end(), 0.f);
      std::fill(zero.begin(), zero.end(), 0.f);
    }
    int r = 0;
    if (a.k % 64 == 0) {  // 16 rows at a time, their dwords transposed in registers
      for (; r + 16 <= rows; r += 16) PackSixteen<W>(a, n0 + r, r);
    }
    for (; r < rows; ++r) {
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
    }
    for (r = 0; r < rows; ++r) {
      const WRow row = RowOf<W>(a, n0 + r);
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t run = row.block_run[b * kBlock / 8];  // one run per block (WholeBlockRuns)
        scale[b * kPanel + r] = row.ScalePortable(run);
        zero[b * kPanel + r] = row.Zero(run);
      }
    }
  }

  // Rows [n, n + 16) into panel rows [r, r + 16): each row's 4-column dwords (4-bit codes
  // first widened to a byte each) are a 16 x 16 dword block per 64 columns, transposed as
  // floats. Scalar packing took a fifth of the 4-bit GEMM's time (perf, kernels_bench
  // --t=512).
  template <WFmt W>
  TGIS_VNNI void PackSixteen(const SmallArgs& a, int64_t n, int r) {
    const uint8_t* src = RowOf<W>(a, n).codes();
    int64_t pitch = a.k;  // bytes per row as the transpose reads them
    if constexpr (W == WFmt::kQ4) {
      thread_local std::vector<uint8_t> wide;
      wide.resize(16 * a.k);
      const __m512i low = _mm512_set1_epi16(0x0F);
      for (int i = 0; i < 16; ++i) {
        const uint8_t* c = src + i * (a.k / 2);
        for (int64_t j = 0; j < a.k / 2; j += 32) {  // 32 bytes -> 64 codes
          const __m512i w =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j)));
          // Word j: byte j's low nibble, then its high one.
          const __m512i pair = _mm512_or_si512(_mm512_and_si512(w, low),
                                               _mm512_slli_epi16(_mm512_srli_epi16(w, 4), 8));
          _mm512_storeu_si512(&wide[i * a.k + 2 * j], pair);
        }
      }
      src = wide.data();
    }
    for (int64_t s = 0; s < a.k / 4; s += 16) {
      Transpose16(reinterpret_cast<const float*>(src + 4 * s), pitch / 4,
                  reinterpret_cast<float*>(&codes[(s * kPanel + r) * 4]), kPanel);
    }
  }
};

// out[t0 .. t0 + TT) of the panel's 32 rows (two zmm of 16).
template <int TT, bool kOneRun>
TGIS_VNNI void Tile(const SmallArgs& a, const Int8Blocks& x, const Panel& p, int64_t n0,
                    int64_t t0) {
  const int64_t blocks = a.k / kBlock;
  __m512 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[TT][2];
    for (int t = 0; t < TT; ++t) dot[t][0] = dot[t][1] = _mm512_setzero_si512();
    const uint8_t* w = &p.codes[b * kBlock * kPanel];
    const int8_t* xq = &x.q[t0 * a.k + b * kBlock];
#pragma GCC unroll 8
    for (int s = 0; s < kBlock / 4; ++s) {
      const __m512i w0 = _mm512_loadu_si512(w + s * 4 * kPanel);
      const __m512i w1 = _mm512_loadu_si512(w + s * 4 * kPanel + 64);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        int32_t four;
        std::memcpy(&four, xq + t * a.k + 4 * s, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        dot[t][0] = DotAdd(dot[t][0], w0, xv);
        dot[t][1] = DotAdd(dot[t][1], w1, xv);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 ws = _mm512_loadu_ps(&p.scale[b * kPanel + 16 * h]);
      const __m512 wz = _mm512_loadu_ps(&p.zero[b * kPanel + 16 * h]);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int64_t at = (t0 + t) * blocks + b;
        const __m512 exact =
            _mm512_fnmadd_ps(wz, _mm512_set1_ps(x.sum[at]), _mm512_cvtepi32_ps(dot[t][h]));
        // One run per row: the weight's scale is applied once, at the end.
        const __m512 by =
            kOneRun ? _mm512_set1_ps(x.scale[at]) : _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[at]));
        acc[t][h] = _mm512_fmadd_ps(exact, by, acc[t][h]);
      }
    }
  }
  if constexpr (kOneRun) {
    for (int h = 0; h < 2; ++h) {
      const __m512 ws = _mm512_loadu_ps(&p.scale[16 * h]);
      for (int t = 0; t < TT; ++t) acc[t][h] = _mm512_mul_ps(acc[t][h], ws);
    }
  }
  const int rows = static_cast<int>(std::min<int64_t>(kPanel, a.n - n0));
  for (int h = 0; h < 2; ++h) {
    const int in_half = std::clamp(rows - 16 * h, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << in_half) - 1);
    const __m512 bias =
        a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0 + 16 * h) : _mm512_setzero_ps();
    for (int t = 0; t < TT; ++t) {
      _mm512_mask_storeu_ps(a.out + (t0 + t) * a.n + n0 + 16 * h, mask,
                            _mm512_add_ps(acc[t][h], bias));
    }
  }
}

template <WFmt W>
void Gemm(const SmallArgs& a, const Int8Blocks& x) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel;
  const bool one_run = a.q->runs() == 1;
  ParallelFor(panels, 1, [&](int64_t b, int64_t e) {
    thread_local Panel p;
    for (int64_t i = b; i < e; ++i) {
      const int64_t n0 = i * kPanel;
      p.template Pack<W>(a, n0);
      int64_t t0 = 0;
      // Tiles of kTokens tokens, then one of 3, then single tokens.
      auto tiles = [&](auto one_run_constant) {
        constexpr bool kOneRun = decltype(one_run_constant)::value;
        for (; t0 + kTokens <= a.t; t0 += kTokens) Tile<kTokens, kOneRun>(a, x, p, n0, t0);
        if (t0 + 3 <= a.t) {
          Tile<3, kOneRun>(a, x, p, n0, t0);
          t0 += 3;
        }
        for (; t0 < a.t; ++t0) Tile<1, kOneRun>(a, x, p, n0, t0);
      };
      if (one_run) {
        tiles(std::true_type{});
      } else {
        tiles(std::false_type{});
      }
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

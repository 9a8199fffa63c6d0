// Linear's opt-in streaming kernel for 4-bit codes with x rounded to int8 (SetInt8Activations;
// the shard's --cpu-int8-activations) on AVX-512 VNNI: llama.cpp's way of multiplying 4-bit
// weights, with integer dot products 128 columns at a time, one weight row after another. (On
// AVX2 the codes interleaved 8 rows at a time run faster: linear_q4_panels.cc. Not yet measured
// here on VNNI, where this row kernel stays.)
//
// Why opt-in: x rounded to int8 per 32 columns (scale = the block's absmax / 127, as
// llama.cpp's Q8_0) is an activation error of up to 0.4% per element, so outputs are no
// longer those of transformers on the dequantized weights within 1e-4; what it buys is a third
// of the instructions per weight of the exact kernels, whose 4-bit decode is bound by them
// rather than by memory.
//
// Layout. A 128-column chunk of a row is 64 code bytes; byte 16b + i holds columns 32b + 2i
// (low nibble) and 32b + 2i + 1 (high nibble), so dword lane l of the chunk covers columns
// [8l, 8l + 8) and block l / 4. x is prepared once per call as int8 in the same order (its even
// columns' bytes, then its odd columns'), with, per lane, its block's scale and the sum of its 8
// codes. Per lane: I = sum of code * xq over its 8 columns (exact: vpdpbusd), then
// (I - zero * sum(xq)) exactly in f32 (integers below 2^24), times the weight's and x's scales,
// added into 16 f32 lanes; the output is their sum, plus the bias. A row's result depends only on
// its own x row: the same at any T, in any batch, on any number of threads.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kChunk = 128;  // columns per step: 64 code bytes, 16 dword lanes

TGIS_VNNI inline __m512i DotAdd(__m512i acc, __m512i codes, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
  return acc;
}

// The row's scales and zeros of the chunk's four blocks (lane b: block b), in either form of
// run constants (WRow).
struct FourRuns {
  __m128 scale, zero;
};
TGIS_AVX2 inline FourRuns RunsOf(const WRow& row, const Int8X::Chunk& c) {
  const int32_t* run = c.run;
  if (c.kind == Int8X::Chunk::kUniform) {
    return {_mm_set1_ps(row.Scale(run[0])), _mm_set1_ps(row.Zero(run[0]))};
  }
  if (c.kind == Int8X::Chunk::kConsecutive) {
    if (!row.compact()) return {_mm_loadu_ps(row.scale + run[0]), _mm_loadu_ps(row.zero + run[0])};
    int32_t zeros;
    std::memcpy(&zeros, row.zero_b + run[0], 4);
    return {_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.scale_h + run[0]))),
            _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(zeros)))};
  }
  return {_mm_setr_ps(row.Scale(run[0]), row.Scale(run[1]), row.Scale(run[2]), row.Scale(run[3])),
          _mm_setr_ps(row.Zero(run[0]), row.Zero(run[1]), row.Zero(run[2]), row.Zero(run[3]))};
}

// Four per-block values as the VNNI kernel's 16 dword lanes (lanes 4b to 4b + 3: block b).
TGIS_VNNI inline __m512 PerLane(__m128 four) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                               _mm512_castps128_ps512(four));
}

// Row n against x rows [t0, t0 + TT): acc[t0 + t] gets each token's 16 lane sums.
template <int TT>
TGIS_VNNI void Dots(const SmallArgs& a, const Int8X& x, int64_t n, int64_t t0, __m512* acc) {
  const WRow row = RowOf<WFmt::kQ4>(a, n);
  const int64_t chunks = a.k / kChunk;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 sum[TT];
  for (int t = 0; t < TT; ++t) sum[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const Int8X::Chunk& ch = x.chunks[c];
    PrefetchCodesAhead(row.codes() + c * 64);  // one cache line per chunk
    const __m512i bytes = _mm512_loadu_si512(row.codes() + c * 64);
    const __m512i lo = _mm512_and_si512(bytes, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    const FourRuns runs = RunsOf(row, ch);
    const __m512 w_scale = PerLane(runs.scale);
    const __m512 w_zero = PerLane(runs.zero);
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      const int64_t at = ((t0 + t) * chunks + c);
      __m512i dot = DotAdd(_mm512_setzero_si512(), lo, _mm512_loadu_si512(&x.even[at * 64]));
      dot = DotAdd(dot, hi, _mm512_loadu_si512(&x.odd[at * 64]));
      const __m512 exact =
          _mm512_fnmadd_ps(w_zero, _mm512_loadu_ps(&x.lane_sum[at * 16]), _mm512_cvtepi32_ps(dot));
      sum[t] = _mm512_fmadd_ps(
          exact, _mm512_mul_ps(w_scale, _mm512_loadu_ps(&x.lane_scale[at * 16])), sum[t]);
    }
  }
  for (int t = 0; t < TT; ++t) acc[t0 + t] = sum[t];
}

TGIS_VNNI void Row(const SmallArgs& a, const Int8X& x, int64_t n) {
  alignas(64) __m512 acc[kSmallT];
  int64_t t0 = 0;
  for (; t0 + 2 <= a.t; t0 += 2) Dots<2>(a, x, n, t0, acc);
  if (t0 < a.t) Dots<1>(a, x, n, t0, acc);
  float sums[kSmallT];
  for (int64_t t = 0; t < a.t; ++t) sums[t] = _mm512_reduce_add_ps(acc[t]);
  StoreRow(a, n, sums);
}

}  // namespace

bool Int8X::Prepare(const float* x, int64_t t, int64_t k, const int32_t* block_run) {
  if (k % kChunk != 0 || !blocks.Prepare(x, t, k)) return false;
  const int64_t chunks = k / kChunk;
  this->chunks.clear();
  for (int64_t c = 0; c < chunks; ++c) {
    const int32_t* run = block_run + c * kChunk / 8;  // one entry per 8 columns
    Chunk ch;
    bool uniform = true, consecutive = true;
    for (int b = 0; b < 4; ++b) {
      ch.run[b] = run[4 * b];  // each block is one run (WholeBlockRuns)
      uniform &= ch.run[b] == run[0];
      consecutive &= ch.run[b] == run[0] + b;
    }
    ch.kind = uniform ? Chunk::kUniform : consecutive ? Chunk::kConsecutive : Chunk::kAny;
    this->chunks.push_back(ch);
  }
  even.resize(t * k / 2);
  odd.resize(t * k / 2);
  lane_scale.resize(t * chunks * 16);
  lane_sum.resize(t * chunks * 16);
  for (int64_t at = 0; at < t * chunks; ++at) {  // (token, chunk): x's columns are contiguous
    const int8_t* q = &blocks.q[at * kChunk];
    for (int l = 0; l < 16; ++l) {
      int sum = 0;
      for (int m = 0; m < 4; ++m) {
        even[at * 64 + 4 * l + m] = q[8 * l + 2 * m];
        odd[at * 64 + 4 * l + m] = q[8 * l + 2 * m + 1];
        sum += q[8 * l + 2 * m] + q[8 * l + 2 * m + 1];
      }
      lane_scale[at * 16 + l] = blocks.scale[at * 4 + l / 4];
      lane_sum[at * 16 + l] = static_cast<float>(sum);
    }
  }
  return true;
}

void SmallQ4Int8X(const SmallArgs& a, const Int8X& x, int64_t n0, int64_t n1) {
  // One row after another, as SmallQ8Int8X: measured on Zen 4 (kernels_bench --t=1
  // --int8-activations gptq4g32, 2 threads), 4096x4096 0.41 ms against 0.67 with tiles of 4
  // rows and software prefetch.
  for (int64_t n = n0; n < n1; ++n) Row(a, x, n);
}

}  // namespace tgis::kernels::cpu

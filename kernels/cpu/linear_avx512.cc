// Linear's streaming (decode) kernel with AVX-512, for CPUs that have it (chosen at run time).
//
// Why a second kernel: at batch 1 the AVX2 kernel spends more instructions per weight than the
// memory system needs time to deliver it, most of all for quantized codes (8-bit codes reached a
// third of the DRAM bandwidth, 4-bit a sixth). Here a step covers 32 columns of a row as two
// 16-lane vectors and the dequantization is cheaper:
//  - 4-bit codes index a 16-entry table of the run's dequantized values, (i - zero) * scale
//    or, for codes that index a codebook (nf4, fp4, MXFP4), codebook[i] * scale, with one
//    permute per 16 weights. The codes of a 32-column block come out as its even
//    columns and then its odd ones, so x is reordered to match once per call
//    (Avx512OrderX);
//  - bf16 rows are widened by interleaving a 64-byte load with zeros within 128-bit lanes,
//    which puts columns 0-3 8-11 16-19 24-27 of a block in the first vector and the rest in
//    the second; x is reordered to match and padded to whole blocks (Avx512OrderX);
//  - 8-bit codes, fp8 and f16 are widened and converted as in the AVX2 kernel, 16 at a time.
// Every weight is the f32 value Dequantize gives (exactly), so the kernel equals a dense f32
// Linear on the dequantized weight up to summation order, as the AVX2 one does.
//
// Summation order, fixed per row whatever T, the batch or the threads: two sets of 16 lanes,
// one adding its column of each block's first vector, the other of its second, block after
// block; then the two added lane by lane, _mm512_reduce_add_ps and the bias. (Two independent
// FMA chains per row let a tile of one row keep up with the memory: see SmallAvx512.) A partial
// last block (float weights only) reads zeros. T <= 2 applies each decoded weight vector to every x
// row in registers; larger T decodes a chunk of rows into scratch once and sums from there, in the
// same order.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "kernels/cpu/linear_stream.h"

// GCC 12 reports the deliberately undefined pass-through operand of its own AVX-512 intrinsics
// (_mm512_undefined_epi32 in _mm512_cvtepi8_epi32, _mm512_slli_epi32) as maybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace tgis::kernels::cpu {

namespace {

#define TGIS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

constexpr int64_t kBlock = kAvx512Block;  // columns per step: two 16-lane vectors
constexpr int64_t kChunk = 512;           // columns per scratch chunk; a multiple of kBlock
constexpr int kRows = 4;                  // weight rows per tile (float rows at T = 1: one)

// Lanes of a block's two halves that hold columns (all, except in a float tail block).
struct Mask {
  __mmask16 lo = 0xFFFF, hi = 0xFFFF;
};

Mask TailMask(int64_t columns) {
  Mask m;
  m.lo = static_cast<__mmask16>(columns >= 16 ? 0xFFFF : (1u << columns) - 1);
  m.hi = static_cast<__mmask16>(columns <= 16 ? 0 : (1u << (columns - 16)) - 1);
  return m;
}

// Each byte's value as a float: compact zeros looked up rather than converted.
constexpr auto kByteValue = [] {
  std::array<float, 256> v{};
  for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(i);
  return v;
}();

// A cache line of the row's run constants from run r on (16 runs of f32; compact: 32 of f16
// and 64 of bytes), so that the next runs are in cache when the kernel gets there.
TGIS_AVX512 inline void PrefetchRuns(const WRow& row, int64_t r) {
  const char* s = row.compact() ? reinterpret_cast<const char*>(row.scale_h + r)
                                : reinterpret_cast<const char*>(row.scale + r);
  const char* z = row.compact() ? reinterpret_cast<const char*>(row.zero_b + r)
                                : reinterpret_cast<const char*>(row.zero + r);
  _mm_prefetch(s, _MM_HINT_T0);
  _mm_prefetch(z, _MM_HINT_T0);
}

// One weight row being decoded block by block; quantized rows keep their current run's
// constants in registers and renew them when the run changes.
template <WFmt W>
struct RowDecoder {
  WRow row;
  int32_t run = -1;
  int64_t runs_ahead = 0;  // how far ahead to prefetch the per-run scales and zeros
  __m512 zero, scale, table;

  TGIS_AVX512 void Enter(int64_t k) {
    const int32_t r = row.block_run[k / 8];
    if (r == run) return;
    run = r;
    if (r % 16 == 0) PrefetchRuns(row, r + runs_ahead);
    if constexpr (W == WFmt::kQ4) {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(row.Zero(r))),
                            _mm512_set1_ps(row.Scale(r)));
    } else if constexpr (W == WFmt::kLut4) {
      // The codebook reloads from L1 once a run: a register held for it would take one of the
      // tile's 32 per row.
      table = _mm512_mul_ps(_mm512_loadu_ps(row.lut), _mm512_set1_ps(row.Scale(r)));
    } else {
      zero = _mm512_set1_ps(row.zero[r]);
      scale = _mm512_set1_ps(row.scale[r]);
    }
  }

  // The weights of the block at kernel column k (a multiple of kBlock) as two vectors;
  // masked-off lanes read nothing and hold 0 (float formats only).
  template <bool kTail>
  TGIS_AVX512 inline void Block(int64_t k, Mask m, __m512* lo, __m512* hi) {
    if constexpr (W == WFmt::kF32) {
      const float* p = static_cast<const float*>(row.p) + k;
      *lo = kTail ? _mm512_maskz_loadu_ps(m.lo, p) : _mm512_loadu_ps(p);
      *hi = kTail ? _mm512_maskz_loadu_ps(m.hi, p + 16) : _mm512_loadu_ps(p + 16);
    } else if constexpr (W == WFmt::kBF16) {
      // One load and two in-lane interleaves with zero: each value lands in the top half of
      // a 32-bit lane, which is its f32 (columns in Avx512OrderX's order). Two
      // half-block loads widened across lanes measured slower from memory: a third more
      // instructions per byte left one core short of the DRAM stream (EPYC Zen 4).
      const uint16_t* p = static_cast<const uint16_t*>(row.p) + k;
      const __m512i v = kTail ? _mm512_maskz_loadu_epi16(m.lo | (__mmask32{m.hi} << 16), p)
                              : _mm512_loadu_si512(p);
      *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
      *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
    } else if constexpr (W == WFmt::kF16) {
      // One 64-byte load, as for bf16: two 32-byte loads of each line measured slower from
      // memory (EPYC Zen 4).
      const uint16_t* p = static_cast<const uint16_t*>(row.p) + k;
      const __m512i v = kTail ? _mm512_maskz_loadu_epi16(m.lo | (__mmask32{m.hi} << 16), p)
                              : _mm512_loadu_si512(p);
      *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
      *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
    } else if constexpr (W == WFmt::kQ4 || W == WFmt::kLut4) {
      Enter(k);
      // Byte i of the block holds columns 2i (low nibble) and 2i + 1; the permute reads only
      // the low 4 bits of each index.
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row.p) + k / 2)));
      *lo = _mm512_permutexvar_ps(codes, table);
      *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    } else {
      Enter(k);
      const uint8_t* p = static_cast<const uint8_t*>(row.p) + k;
      *lo = Codes16(p);
      *hi = Codes16(p + 16);
    }
  }

  TGIS_AVX512 inline __m512 Codes16(const uint8_t* p) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (W == WFmt::kF8) {
      // Sign-extended, shifted so the magnitude bits land on f32's exponent and mantissa top
      // and the sign on f32's; times 2^120 that is the code's value exactly (as in linear.cc),
      // and then times the scale, rounded once as Dequantize rounds it.
      const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20),
                                            _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
      return _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f)),
                           scale);
    } else {
      return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), zero),
                           scale);
    }
  }
};

// acc[2 (r * T + t) + h] += half h of the blocks [k0, k1) of row r against x row t (T = TT
// here), in registers. m masks the weights' columns in a tail block, xm x's lanes.
template <int R, int TT, WFmt W, bool kTail>
TGIS_AVX512 inline void Direct(RowDecoder<W>* dec, const float* x, int64_t ldx, int64_t k0,
                               int64_t k1, Mask m, Mask xm, int64_t prefetch, __m512* acc) {
  __m512 a[R][TT][2];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) a[r][t][h] = acc[2 * (r * TT + t) + h];
  for (int64_t k = k0; k < k1; k += kBlock) {
    __m512 xl[TT], xh[TT];
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      const float* xp = x + t * ldx + k;
      xl[t] = kTail ? _mm512_maskz_loadu_ps(xm.lo, xp) : _mm512_loadu_ps(xp);
      xh[t] = kTail ? _mm512_maskz_loadu_ps(xm.hi, xp + 16) : _mm512_loadu_ps(xp + 16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 lo, hi;
      if constexpr (W != WFmt::kF32 && W != WFmt::kBF16 && W != WFmt::kF16) {
        // Quantized rows are short streams (1-4 KB) that the hardware prefetcher picks up
        // late: fetch the same column of the rows two tiles on.
        const int64_t byte = W == WFmt::kQ4 || W == WFmt::kLut4 ? k / 2 : k;
        _mm_prefetch(static_cast<const char*>(dec[r].row.p) + byte + prefetch, _MM_HINT_T0);
      }
      dec[r].template Block<kTail>(k, m, &lo, &hi);
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) {
        a[r][t][0] = _mm512_fmadd_ps(lo, xl[t], a[r][t][0]);
        a[r][t][1] = _mm512_fmadd_ps(hi, xh[t], a[r][t][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[2 * (r * TT + t) + h] = a[r][t][h];
}

// Direct for 4-bit codes (whole blocks [0, full)): the same sums in the same order, with each
// row's 16-entry table in a register, the block's run looked up once for all rows, and one
// code prefetch per cache line. (Direct's general decoder kept the tables in memory and
// measured at a third of the DRAM bandwidth on 4-bit g32 weights.)
// kCompact: the weight's run constants are compact (f16 scales, byte zeros), read without a
// branch per row and run, the zeros through a table (no int-to-float conversion on the way).
template <int R, int TT, WFmt W, bool kCompact>
TGIS_AVX512 inline void DirectQ4(const SmallArgs& a, int64_t n, int64_t full, __m512* acc) {
  WRow rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowOf<W>(a, n + r);
  const int32_t* block_run = a.q->block_run.data<int32_t>();
  const int64_t ahead = 2 * kRows * a.q->codes.dim(1);  // bytes: the rows two tiles on
  const int64_t runs_ahead = 2 * kRows * a.q->runs();   // their scales and zeros
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 codebook = W == WFmt::kLut4 ? _mm512_loadu_ps(rows[0].lut) : iota;
  __m512 acc_r[R][TT][2], table[R];
  for (int r = 0; r < R; ++r) {
    table[r] = _mm512_setzero_ps();
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc_r[r][t][h] = acc[2 * (r * TT + t) + h];
  }
  int32_t run = -1;
  for (int64_t k = 0; k < full; k += kBlock) {
    const int32_t block = block_run[k / 8];
    if (block != run) {
      run = block;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (run % 16 == 0) PrefetchRuns(rows[r], run + runs_ahead);
        const float scale = kCompact ? _cvtsh_ss(rows[r].scale_h[run]) : rows[r].scale[run];
        if constexpr (W == WFmt::kLut4) {
          table[r] = _mm512_mul_ps(codebook, _mm512_set1_ps(scale));
        } else {
          const float zero = kCompact ? kByteValue[rows[r].zero_b[run]] : rows[r].zero[run];
          table[r] =
              _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
        }
      }
    }
    __m512 xl[TT], xh[TT];
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      xl[t] = _mm512_loadu_ps(a.x + t * a.k + k);
      xh[t] = _mm512_loadu_ps(a.x + t * a.k + k + 16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (k % 128 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r].codes() + k / 2 + ahead), _MM_HINT_T0);
      const __m512i idx = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r].codes() + k / 2)));
      const __m512 lo = _mm512_permutexvar_ps(idx, table[r]);
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table[r]);
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) {
        acc_r[r][t][0] = _mm512_fmadd_ps(lo, xl[t], acc_r[r][t][0]);
        acc_r[r][t][1] = _mm512_fmadd_ps(hi, xh[t], acc_r[r][t][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[2 * (r * TT + t) + h] = acc_r[r][t][h];
}

// The same sums from weights already decoded into scratch rows, or f32 weight rows read in
// place (`ld` floats apart; column 0 is kernel column k0), for x rows [t0, t0 + TT) of T. Masked
// loads only in a tail block: GCC keeps the accumulators in registers across plain loads but not
// across masked ones.
template <int R, int TT, bool kTail>
TGIS_AVX512 inline void FromScratch(const float* w, int64_t ld, const float* x, int64_t ldx,
                                    int64_t k0, int64_t k1, Mask m, int64_t t0, int64_t t_count,
                                    __m512* acc) {
  __m512 a[R][TT][2];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) a[r][t][h] = acc[2 * (r * t_count + t0 + t) + h];
  for (int64_t k = k0; k < k1; k += kBlock) {
    __m512 xl[TT], xh[TT];
#pragma GCC unroll 2
    for (int t = 0; t < TT; ++t) {
      const float* xp = x + (t0 + t) * ldx + k;
      xl[t] = kTail ? _mm512_maskz_loadu_ps(m.lo, xp) : _mm512_loadu_ps(xp);
      xh[t] = kTail ? _mm512_maskz_loadu_ps(m.hi, xp + 16) : _mm512_loadu_ps(xp + 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* wr = w + r * ld + (k - k0);
      __m512 lo = _mm512_loadu_ps(wr), hi = _mm512_loadu_ps(wr + 16);
      // In registers, once for the TT tokens: GCC otherwise folds the load into each token's
      // FMA, and Zen 4's two 256-bit load ports then bind the loop before its FMAs do
      // (kernels_bench --quick --hot --t=16 --shape=1024x2048: f32 129-135 -> 172-174 GFLOP/s,
      // f16 99-124 -> 163).
      __asm__("" : "+v"(lo), "+v"(hi));
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) {
        a[r][t][0] = _mm512_fmadd_ps(lo, xl[t], a[r][t][0]);
        a[r][t][1] = _mm512_fmadd_ps(hi, xh[t], a[r][t][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[2 * (r * t_count + t0 + t) + h] = a[r][t][h];
}

// FromScratch over the chunk [c0, c0 + len): its whole blocks, then a partial one if any.
template <int R, int TT>
TGIS_AVX512 void ChunkFromScratch(const float* w, int64_t ld, const float* x, int64_t ldx,
                                  int64_t c0, int64_t len, Mask tail, int64_t t0, int64_t t_count,
                                  __m512* acc) {
  const int64_t whole = c0 + len / kBlock * kBlock;
  FromScratch<R, TT, false>(w, ld, x, ldx, c0, whole, Mask{}, t0, t_count, acc);
  if (whole < c0 + len) {
    FromScratch<R, TT, true>(w + (whole - c0), ld, x, ldx, whole, c0 + len, tail, t0, t_count, acc);
  }
}

// All T rows of x against weight rows [n, n + R).
template <int R, WFmt W>
TGIS_AVX512 void Tile(const SmallArgs& a, int64_t n) {
  const int64_t t_count = a.t;
  const int64_t full = a.k / kBlock * kBlock;  // quantized weights have no partial block
  const Mask tail = TailMask(a.k - full);
  // x in bf16's column order: rows padded to whole blocks with zeros, read unmasked.
  const int64_t ldx = Avx512OrdersX(W) ? Avx512OrderedWidth(a.k) : a.k;
  const Mask x_tail = W == WFmt::kBF16 ? Mask{} : tail;
  RowDecoder<W> dec[R];
  for (int r = 0; r < R; ++r) {
    dec[r].row = RowOf<W>(a, n + r);
    if (a.q) dec[r].runs_ahead = 2 * kRows * a.q->runs();  // the rows two tiles on
  }
  alignas(64) __m512 acc[2 * R * kSmallT];  // [R][T][2 halves]
  for (int64_t i = 0; i < 2 * R * t_count; ++i) acc[i] = _mm512_setzero_ps();

  if (t_count <= 2) {
    const int64_t prefetch = a.q ? 2 * kRows * a.q->codes.dim(1) : 0;  // bytes
    if constexpr (W == WFmt::kQ4 || W == WFmt::kLut4) {                // no partial block
      const bool compact = a.q->compact();
      if (t_count == 1) {
        compact ? DirectQ4<R, 1, W, true>(a, n, full, acc)
                : DirectQ4<R, 1, W, false>(a, n, full, acc);
      } else {
        compact ? DirectQ4<R, 2, W, true>(a, n, full, acc)
                : DirectQ4<R, 2, W, false>(a, n, full, acc);
      }
    } else if (t_count == 1) {
      Direct<R, 1, W, false>(dec, a.x, ldx, 0, full, Mask{}, Mask{}, prefetch, acc);
      if (full < a.k) {
        Direct<R, 1, W, true>(dec, a.x, ldx, full, a.k, tail, x_tail, prefetch, acc);
      }
    } else {
      Direct<R, 2, W, false>(dec, a.x, ldx, 0, full, Mask{}, Mask{}, prefetch, acc);
      if (full < a.k) {
        Direct<R, 2, W, true>(dec, a.x, ldx, full, a.k, tail, x_tail, prefetch, acc);
      }
    }
  } else {
    alignas(64) static thread_local float scratch[kRows * (kChunk + kBlock)];
    constexpr int64_t ld = kChunk + kBlock;
    for (int64_t c0 = 0; c0 < a.k; c0 += kChunk) {
      const int64_t len = std::min(kChunk, a.k - c0);
      if (W == WFmt::kF32 && len % kBlock == 0) {  // whole f32 blocks: read them in place
        const float* w = static_cast<const float*>(a.w) + n * a.k + c0;
        int64_t t0 = 0;
        for (; t0 + 2 <= t_count; t0 += 2)
          ChunkFromScratch<R, 2>(w, a.k, a.x, a.k, c0, len, tail, t0, t_count, acc);
        if (t0 < t_count) ChunkFromScratch<R, 1>(w, a.k, a.x, a.k, c0, len, tail, t0, t_count, acc);
        continue;
      }
      for (int r = 0; r < R; ++r) {
        for (int64_t k = 0; k < len; k += kBlock) {
          __m512 lo, hi;
          if (c0 + k + kBlock <= a.k) {
            dec[r].template Block<false>(c0 + k, Mask{}, &lo, &hi);
          } else {
            dec[r].template Block<true>(c0 + k, tail, &lo, &hi);
          }
          _mm512_store_ps(scratch + r * ld + k, lo);
          _mm512_store_ps(scratch + r * ld + k + 16, hi);
        }
      }
      int64_t t0 = 0;
      for (; t0 + 2 <= t_count; t0 += 2)
        ChunkFromScratch<R, 2>(scratch, ld, a.x, ldx, c0, len, x_tail, t0, t_count, acc);
      if (t0 < t_count)
        ChunkFromScratch<R, 1>(scratch, ld, a.x, ldx, c0, len, x_tail, t0, t_count, acc);
    }
  }
  // The direct path keeps acc as [R][T][2] too (T = TT there).
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < t_count; ++t) {
      const int64_t i = 2 * (r * t_count + t);
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc[i + 1]));
      if (a.bias) s += a.bias[n + r];
      a.out[t * a.n + n + r] = s;
    }
  }
}

}  // namespace

bool CpuHasAvx512() {
  static const bool has = CpuHasAvx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool WholeBlockRuns(const QuantizedWeight* q) {
  if (q == nullptr) return true;
  // Whole blocks, each inside one run (true of the usual group sizes 32, 64, 128 and of
  // per-row scales on widths that are multiples of 32).
  if (q->stored_in % kBlock != 0) return false;
  const int32_t* run = q->block_run.data<int32_t>();
  for (int64_t b = 0; b < q->stored_in / 8; b += kBlock / 8) {
    for (int64_t j = 1; j < kBlock / 8; ++j)
      if (run[b + j] != run[b]) return false;
  }
  return true;
}

namespace {

// Column j of a reordered block holds column map[j] of the block in x.
using BlockOrder = std::array<int, kBlock>;

// 4-bit codes: a block's even columns, then its odd ones.
constexpr BlockOrder kQ4Order = [] {
  BlockOrder m{};
  for (int j = 0; j < kBlock / 2; ++j) m[j] = 2 * j, m[kBlock / 2 + j] = 2 * j + 1;
  return m;
}();

// bf16 widened by unpacklo/hi_epi16 within 128-bit lanes: lane j of the first vector holds
// column 8 (j / 4) + j % 4, of the second that plus 4.
constexpr BlockOrder kBf16Order = [] {
  BlockOrder m{};
  for (int j = 0; j < kBlock / 2; ++j) {
    m[j] = 8 * (j / 4) + j % 4;
    m[kBlock / 2 + j] = m[j] + 4;
  }
  return m;
}();

// Reorders [t, k] rows of x into [t, width] rows (width: k rounded up to whole blocks) by
// `order`, columns past k zero. Whole blocks skip the bounds test.
void OrderBlocks(const float* x, int64_t t, int64_t k, int64_t width, const BlockOrder& order,
                 float* out) {
  for (int64_t i = 0; i < t; ++i) {
    const float* row = x + i * k;
    for (int64_t b = 0; b < width; b += kBlock) {
      float* dst = out + i * width + b;
      if (b + kBlock <= k) {
        for (int64_t j = 0; j < kBlock; ++j) dst[j] = row[b + order[j]];
      } else {  // the last block, padded
        for (int64_t j = 0; j < kBlock; ++j) dst[j] = b + order[j] < k ? row[b + order[j]] : 0.0f;
      }
    }
  }
}

}  // namespace

int64_t Avx512OrderedWidth(int64_t k) { return (k + kBlock - 1) / kBlock * kBlock; }

const float* Avx512OrderX(WFmt w, const float* x, int64_t t, int64_t k) {
  // On a cache line boundary, as the activations are: the kernels' 64-byte loads of x would
  // otherwise each touch two lines.
  thread_local std::vector<float> storage;
  const int64_t width = Avx512OrderedWidth(k);
  storage.resize(t * width + 16);
  float* out = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / 4 % 16) % 16;
  OrderBlocks(x, t, k, width, w == WFmt::kBF16 ? kBf16Order : kQ4Order, out);
  return out;
}

template <WFmt W>
void SmallAvx512(const SmallArgs& a, int64_t n0, int64_t n1) {
  // The tile height changes which rows share a pass, never how a row is summed.
  int64_t n = n0;
  // Float rows at T = 1 go one at a time: one sequential stream per thread, which the
  // hardware prefetchers serve best (EPYC Zen 5, kernels_bench --quick --t=1 bf16, tiles
  // alternated four times: 1 row 36-44 GB/s, 4 rows 33-38, 8 rows 33-38; a row's two FMA
  // chains keep up with that). Quantized rows go 4 at a time, which measured faster on Zen 4
  // (their rows are 1-4 KB of codes plus the scales and zeros).
  if (a.t == 1 && a.q == nullptr) {
    for (; n < n1; ++n) Tile<1, W>(a, n);
  }
  for (; n + kRows <= n1; n += kRows) Tile<kRows, W>(a, n);
  for (; n < n1; ++n) Tile<1, W>(a, n);
}

template void SmallAvx512<WFmt::kF32>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kBF16>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kF16>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kQ8>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kQ4>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kF8>(const SmallArgs&, int64_t, int64_t);
template void SmallAvx512<WFmt::kLut4>(const SmallArgs&, int64_t, int64_t);

}  // namespace tgis::kernels::cpu

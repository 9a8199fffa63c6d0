// Internal: the decode GEMVs of kernels/cuda/linear.cu, for calls of a few rows of x (decode
// steps): one warp an output row, streaming the row's weights in 16-byte loads, x re-read from
// cache by every warp. Dense weights (bf16, f16, f32) and quantized ones (kernels/quantized.h's
// layout: 8- or 4-bit codes, a scale and a zero per run of columns) read each weight byte once
// a step.
//
// Like attention_common.cuh, it needs its includer to provide the CUDA keywords and primitives
// (uint4, __ldcs, __byte_perm, __uint_as_float, PrefetchL2, PriorGridsDone, WarpSum, ToF32):
// common.cuh and warp_reduce.cuh in the build, or the warp emulator of
// tests/unit/warp_emulator.h, under which a test runs these kernels on the CPU.
#pragma once

#include <cstdint>

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host, and the
// two definitions must not meet at link time.
namespace {

// Rows of x a call may have: kGemvTokens for dense weights (decode is batch invariant up to
// there), kQuantizedGemvTokens for quantized ones (batch-16 decode dequantized every weight a
// step before: 141 ms a step for the 8B shape on the H100, against 8.7 in bf16).
constexpr int kGemvTokens = 8;
constexpr int kQuantizedGemvTokens = 16;
constexpr int kGemvWarps = 8;  // output rows per thread block

// float8 e4m3fn to f32 as kernels::Fp8E4M3ToF32 (the loader rejects NaN codes).
__device__ __forceinline__ float Fp8E4M3ToF32Device(uint32_t v) {
  const uint32_t bits = ((v & 0x7F) << 20) | ((v & 0x80) << 24);
  return __uint_as_float(bits) * 0x1p120f;
}

// What a code stands for before its zero and scale: the integer itself, a float8 e4m3 value,
// or an entry of a 16-value table (QuantizedWeight::codebook); passed to kernels by value and
// read by them through CodeTable.
struct CodeValues {
  enum Kind { kInteger, kFp8, kTable } kind = kInteger;
  float table[16] = {};
};

// A kernel's view of CodeValues, its table in shared memory: a by-value parameter indexed by
// a run-time code is copied to local memory by every thread, and on the H100 that made nf4
// decode four times slower than int8. Call from every thread of the block, before any returns.
struct CodeTable {
  CodeValues::Kind kind;
  const float* table;
};

__device__ __forceinline__ CodeTable LoadCodeTable(const CodeValues& values, float* shared) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) shared[i] = values.table[i];
  }
  __syncthreads();
  return {values.kind, shared};
}

// 2^23 + c for a small integer c as float bits: the integer's value as (bits - 2^23) with
// integer operations and one exact subtraction, where I2F would take the conversion unit (an
// eighth of the FMA rate on the H100, and what bounded int8 decode there).
constexpr uint32_t kMagicBits = 0x4B000000u;
constexpr float kMagic = 8388608.0f;

__device__ __forceinline__ float CodeValue(const CodeTable& v, uint32_t code) {
  return v.kind == CodeValues::kTable ? v.table[code & 15]
         : v.kind == CodeValues::kFp8 ? Fp8E4M3ToF32Device(code)
                                      : __uint_as_float(kMagicBits | code) - kMagic;
}

// The eight codes of one 8-column block less their run's zero, CodeValue(code) - zero: `lo`
// holds the codes (4-bit) or the first four (8-bit, `hi` the other four). The kind is tested
// once per block, not per code; a table comes with 4-bit codes only and float8 with 8-bit ones
// (QuantizedGemv checks). Integer codes with an integer zero (GPTQ, AWQ, int8 rows) take one
// exact subtraction a code, (2^23 + code) - (2^23 + zero); a zero with a fraction the two
// subtractions of CodeValue and then the zero, as DequantizeKernel rounds them.
template <int kBits>
__device__ __forceinline__ void BlockCodeValues(const CodeTable& v, uint32_t lo, uint32_t hi,
                                                float zero, float* out) {
  if (v.kind == CodeValues::kInteger) {
    const float biased = kMagic + zero;
    const bool integer_zero = biased - kMagic == zero;  // the subtraction is exact
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t bits = kBits == 8 ? __byte_perm(i < 4 ? lo : hi, 0x4B00u, 0x5440u + i % 4)
                                       : kMagicBits | ((lo >> (4 * i)) & 0xF);
      out[i] = __uint_as_float(bits) - (integer_zero ? biased : kMagic);
    }
    if (integer_zero) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] -= zero;
    return;
  }
  if constexpr (kBits == 4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = v.table[(lo >> (4 * i)) & 0xF] - zero;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = Fp8E4M3ToF32Device(((i < 4 ? lo : hi) >> (8 * (i % 4))) & 0xFF) - zero;
  }
}

// Streams a row of `vecs` 16-byte vectors through accumulate(vector, index): lane l takes
// vectors l, l + 32, ..., kUnroll at a time, and the next kUnroll loads are issued before this
// chunk's arithmetic, so they are in flight while it runs (loads bypass L1: each byte is read
// once). Without that, ptxas sank each load next to its use to save registers (2 of 4 in
// flight, SASS showed), and batch-1 decode of the 8B shape ran at 13.5 ms/token against
// cuBLASLt's 9.0 on the H100.
// PriorGridsDone comes after the first kUnroll loads and a prefetch of the chunk after them into
// L2 (a weight is no kernel's output): with programmatic dependent launch two chunks a warp
// (4 KB of a bf16 row) stream from the HBM while the kernel before (a norm, attention, the
// gated activation) finishes, and accumulate, which reads x, runs after it.
template <int kUnroll, typename Accumulate>
__device__ __forceinline__ void StreamRow(const uint4* row, int64_t vecs, int lane,
                                          Accumulate&& accumulate) {
  constexpr int64_t kChunk = 32 * kUnroll;  // vectors per warp and chunk
  const int64_t chunks = vecs / kChunk;
  uint4 cur[kUnroll];
  if (chunks > 0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) cur[u] = __ldcs(row + lane + 32 * u);
  }
  constexpr int kLines = kChunk * 16 / 128;  // 128-byte lines a chunk: one a lane
  if (chunks > 1 && lane < kLines) PrefetchL2(row + kChunk + lane * 8);
  PriorGridsDone();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t v = c * kChunk + lane;
    uint4 next[kUnroll];
    const bool more = c + 1 < chunks;
    if (more) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) next[u] = __ldcs(row + v + kChunk + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) accumulate(cur[u], v + 32 * u);
    if (more) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) cur[u] = next[u];
    }
  }
  for (int64_t v = chunks * kChunk + lane; v < vecs; v += 32) accumulate(__ldcs(row + v), v);
}

// Eight consecutive values of x as f32 (16- or 32-byte aligned loads).
template <typename T>
__device__ __forceinline__ void LoadX8(const T* p, float* v) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ToF32(e[i]);
  }
}

// Writes row n's sums (lane 0), plus the bias, rounded once to TOut.
template <typename T, typename TOut, int kTokens>
__device__ __forceinline__ void StoreRowSums(const float* acc, int tokens, int lane, int64_t n,
                                             int64_t out, const T* bias, TOut* y) {
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t >= tokens) break;
    const float sum = WarpSum(acc[t]);
    if (lane == 0) y[t * out + n] = FromF32<TOut>(bias != nullptr ? sum + ToF32(bias[n]) : sum);
  }
}

// ---- quantized weights -------------------------------------------------------------------
//
// out[t, n] = sum over runs r of scale(n, r) * sum over the run's stored columns j of
// (code(n, j) - zero(n, r)) * x[t, gather(j)] (+ bias[n]), in f32: each 8-column block's
// products summed, then scaled into the row's sum (every 8-column block lies in one run). That is
// Linear on the dequantized weight in f32, (code - zero) * scale, up to the order of the sums
// and the rounding of the products; the weight is not rounded to x's dtype, as the
// dequantize-then-GEMM path (more rows than kQuantizedGemvTokens) rounds it. Against the
// dequantizing GEMV this replaced (the weight made per code, scaled, rounded to x's dtype and
// back), a weight costs a code's extraction, one subtraction and one FMA a token.

// One 16-byte vector of codes (whole 8-column blocks starting at column col0) into the
// accumulators.
template <typename T, int kTokens, int kBits>
__device__ __forceinline__ void AccumulateCodes(const uint4& vec, int64_t col0, const CodeTable& v,
                                                const float* row_scale, const float* row_zero,
                                                const int32_t* block_run, const T* x, int64_t in,
                                                int tokens, float* acc) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&vec);
  constexpr int kBlocks = 16 / kBits;  // 8-column blocks per vector: 4 (4-bit) or 2 (8-bit)
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t col = col0 + 8 * b;
    const int32_t run = block_run[col / 8];
    const float scale = row_scale[run];
    float w[8];
    if constexpr (kBits == 8) {
      BlockCodeValues<8>(v, words[2 * b], words[2 * b + 1], row_zero[run], w);
    } else {
      BlockCodeValues<4>(v, words[b], 0, row_zero[run], w);
    }
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (t < tokens) {
        float xv[8];
        LoadX8(x + t * in + col, xv);
        float block = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) block += w[i] * xv[i];
        acc[t] += scale * block;
      }
    }
  }
}

// For rows of whole 16-byte vectors of codes, x in the stored column order (gathered first for
// act-order weights): each lane reads 16 bytes of codes at a time (32 4-bit or 16 8-bit codes),
// two more in flight while these are summed (StreamRow), and x eight values at a time.
template <typename T, typename TOut, int kTokens, int kBits>
__global__ void __launch_bounds__(kGemvWarps * 32)
    QuantizedGemvWideKernel(const uint8_t* codes, int64_t code_row, CodeValues values,
                            const float* scales, const float* zeros, int64_t runs,
                            const int32_t* block_run, int64_t out, int64_t in, const T* x,
                            int tokens, const T* bias, TOut* y) {
  constexpr int64_t kCols = 128 / kBits;  // columns per vector
  __shared__ float table[16];
  const CodeTable v = LoadCodeTable(values, table);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) {  // the whole warp
    PriorGridsDone();
    return;
  }
  const float* row_scale = scales + n * runs;
  const float* row_zero = zeros + n * runs;
  float acc[kTokens] = {};
  StreamRow<2>(reinterpret_cast<const uint4*>(codes + n * code_row), code_row / 16, lane,
               [&](const uint4& vec, int64_t vi) {
                 AccumulateCodes<T, kTokens, kBits>(vec, vi * kCols, v, row_scale, row_zero,
                                                    block_run, x, in, tokens, acc);
               });
  StoreRowSums<T, TOut, kTokens>(acc, tokens, lane, n, out, bias, y);
}

// The same sums for any row: lane l reads 4 code bytes at a time (each warp load 128
// contiguous bytes of the row; every 4 bytes lie in one 8-column block, so one run) and x one
// value at a time through the weight's gather, if any (-1: padding).
template <typename T, typename TOut>
__global__ void QuantizedGemvKernel(const uint8_t* codes, int64_t code_row, int bits,
                                    CodeValues values, const float* scales, const float* zeros,
                                    int64_t runs, const int32_t* block_run, const int32_t* gather,
                                    int64_t out, int64_t in, const T* x, int tokens, const T* bias,
                                    TOut* y) {
  PriorGridsDone();
  __shared__ float table[16];
  const CodeTable v = LoadCodeTable(values, table);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) return;  // the whole warp: n is the same for its lanes
  const uint32_t* row = reinterpret_cast<const uint32_t*>(codes + n * code_row);
  const float* row_scale = scales + n * runs;
  const float* row_zero = zeros + n * runs;
  const int per_word = bits == 8 ? 4 : 8;
  const int64_t words = code_row / 4;
  float acc[kQuantizedGemvTokens] = {};
  for (int64_t wi = lane; wi < words; wi += 32) {
    const uint32_t word = row[wi];
    const int64_t j0 = wi * per_word;
    const int64_t run = block_run[j0 / 8];
    const float zero = row_zero[run];
    float part[kQuantizedGemvTokens] = {};
    for (int i = 0; i < per_word; ++i) {
      const int64_t col = gather != nullptr ? gather[j0 + i] : j0 + i;
      if (col < 0) continue;  // padding
      const uint32_t code = bits == 8 ? (word >> (8 * i)) & 0xFF : (word >> (4 * i)) & 0xF;
      const float w = CodeValue(v, code) - zero;
#pragma unroll
      for (int t = 0; t < kQuantizedGemvTokens; ++t) {
        if (t < tokens) part[t] += w * ToF32(x[t * in + col]);
      }
    }
#pragma unroll
    for (int t = 0; t < kQuantizedGemvTokens; ++t) acc[t] += row_scale[run] * part[t];
  }
  StoreRowSums<T, TOut, kQuantizedGemvTokens>(acc, tokens, lane, n, out, bias, y);
}

// ---- dense weights -----------------------------------------------------------------------
//
// out[t, n] = x[t] . w[n] (+ bias[n]), f32 products and sums. Decode streams every weight once
// per step, so this is a copy at the HBM's speed or nothing: four 16-byte loads in flight per
// lane (StreamRow). On the H100 cuBLASLt's split-K choices for one row of x ran the 8B shape's
// o_proj at half the copy bandwidth and added a reduction kernel per GEMM. A token's sum does
// not depend on how many rows come with it, so decode is batch invariant up to kGemvTokens.

template <typename T, int kTokens>
__device__ __forceinline__ void AccumulateVec(const uint4& wv, const T* x, int64_t in, int64_t col,
                                              int tokens, float* acc) {
  constexpr int kVec = 16 / sizeof(T);
  const T* wp = reinterpret_cast<const T*>(&wv);
  float wf[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) wf[i] = ToF32(wp[i]);
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t < tokens) {
      const uint4 xv = *reinterpret_cast<const uint4*>(x + t * in + col);
      const T* xp = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[t] += wf[i] * ToF32(xp[i]);
    }
  }
}

// kTokens (1, 2, 4 or 8) bounds the rows of x (fewer accumulators, fewer registers).
template <typename T, typename TOut, int kTokens>
__global__ void __launch_bounds__(kGemvWarps * 32)
    DenseGemvKernel(const T* w, int64_t out, int64_t in, const T* x, int tokens, const T* bias,
                    TOut* y) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) {  // the whole warp: n is the same for its lanes
    PriorGridsDone();
    return;
  }
  float acc[kTokens] = {};
  StreamRow<4>(reinterpret_cast<const uint4*>(w + n * in), in / kVec, lane,
               [&](const uint4& wv, int64_t v) {
                 AccumulateVec<T, kTokens>(wv, x, in, v * kVec, tokens, acc);
               });
  StoreRowSums<T, TOut, kTokens>(acc, tokens, lane, n, out, bias, y);
}

}  // namespace
}  // namespace tgis::kernels::cuda

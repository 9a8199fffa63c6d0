// Internal: the decode GEMV on tensor cores, for 16-bit dense weights and up to kGemvTokens rows
// of x: each mma.m16n8k16 multiplies 16 weight rows by the 8 token rows of x over 16 columns.
//
// Why: the CUDA-core GEMV (gemv.cuh) keeps a float accumulator a token in every lane and
// re-reads and widens x for each one: per 16 bytes of weights, 8 tokens cost 8 loads of x, 64
// conversions and 64 FMAs, and the down projection's x (8 x 14336 bf16) does not fit in L1. On
// the H100, 8 streams through the router decoded at 23 ms a step where 16 rows through cuBLASLt
// take 7.8 (session 33). Here 16 bytes of weights a lane cost one 16-byte load of x and one
// mma for 8 tokens, and 1 token the same.
//
// Layout. Lane l (g = l / 4, q = l % 4) loads 16 bytes of weight rows g and g + 8 and of token
// g's x, at columns c + 8q .. c + 8q + 7 of a 32-column step c. Registers 0-1 of those 16 bytes
// (columns 8q .. 8q + 3) are one mma's k-fragments, registers 2-3 the other's: mma's logical k
// (fragment register r = k >= 8, half k % 2, lane q = (k % 8) / 2) maps to column
// 8q + 2 (k >= 8) + k % 2 (+ 4 for the second mma) for A and B alike, so each product pairs a
// weight with its own column of x, and the two mmas cover the step's 32 columns. Lanes of a
// token past `tokens` load zeros; rows past `out` re-read the last row and are not stored.
//
// Order of the sums: kMmaGemvWarps warps split a block's 16 rows' columns (warp w takes steps
// w, w + kMmaGemvWarps, ...), each accumulating its steps in order in the mma's f32
// accumulators; then the warps' partial sums are added in warp order, and the bias. Nothing
// depends on how many tokens come: a token's output is the same bits alone or beside 7 others,
// as the CUDA-core GEMV's are.
//
// MmaQuantGemvKernel below does the same for 4-bit integer codes (GPTQ, AWQ).
//
// Like gemv.cuh, it needs its includer to provide the CUDA keywords and primitives (uint4,
// __ldcs, __byte_perm, PriorGridsDone, Mma16816, HalfMagicBits, SubHalves, FromF32, ToF32) and
// gemv.cuh's kGemvTokens and kQuantizedGemvTokens: the build's common.cuh, warp_mma.cuh and
// gemv.cuh, or tests/unit/warp_emulator.h.
#pragma once

#include <cstdint>

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host.
namespace {

constexpr int kMmaGemvWarps = 8;  // warps sharing one tile of 16 rows
constexpr int kMmaGemvRows = 16;  // output rows a block
constexpr int kMmaGemvSteps = 4;  // 32-column steps whose loads a warp has in flight
static_assert(kGemvTokens == 8, "one mma.m16n8k16 takes 8 tokens");

// A block's 16 rows' sums: every warp's mma accumulators, acc[h][e] of lane (g, q) for row g
// (+ 8 for e >= 2) and token 8h + 2q + e % 2, added in warp order, plus the bias, stored for the
// rows below `out` and tokens below `tokens`.
template <typename T, typename TOut, int kTokens>
__device__ __forceinline__ void StoreMmaGemvTile(const float (&acc)[kTokens / 8][4], int64_t row0,
                                                 int64_t out, int tokens, const T* bias, TOut* y) {
  __shared__ float partial[kMmaGemvWarps][kMmaGemvRows][kTokens];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < kTokens / 8; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][g + 8 * (e / 2)][8 * h + 2 * q + e % 2] = acc[h][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kMmaGemvRows * kTokens; i += kMmaGemvWarps * 32) {
    const int r = i / kTokens, t = i % kTokens;
    const int64_t n = row0 + r;
    if (n >= out || t >= tokens) continue;
    float sum = 0.0f;
    for (int k = 0; k < kMmaGemvWarps; ++k) sum += partial[k][r][t];
    if (bias != nullptr) sum += ToF32(bias[n]);
    y[static_cast<int64_t>(t) * out + n] = FromF32<TOut>(sum);
  }
}

// One 32-column step: the two mmas over a lane's 16 bytes of rows g, g + 8 and of x.
template <typename T>
__device__ __forceinline__ void MmaGemvStep(const uint4& ra, const uint4& rb, const uint4& xv,
                                            float (&d)[4]) {
  const uint32_t a0[4] = {ra.x, rb.x, ra.y, rb.y}, b0[2] = {xv.x, xv.y};
  const uint32_t a1[4] = {ra.z, rb.z, ra.w, rb.w}, b1[2] = {xv.z, xv.w};
  Mma16816<T>(d, a0, b0);
  Mma16816<T>(d, a1, b1);
}

// y[t, n] = x[t] . w[n] (+ bias[n]) for t < tokens <= kGemvTokens; `in` a multiple of 8, rows
// and x 16-byte aligned (DenseGemvTakes). Grid: one block of kMmaGemvWarps warps per 16 rows.
template <typename T, typename TOut>
__global__ void __launch_bounds__(kMmaGemvWarps * 32)
    MmaGemvKernel(const T* w, int64_t out, int64_t in, const T* x, int tokens, const T* bias,
                  TOut* y) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaGemvRows;
  const uint4* wa = reinterpret_cast<const uint4*>(w + min(row0 + g, out - 1) * in);
  const uint4* wb = reinterpret_cast<const uint4*>(w + min(row0 + g + 8, out - 1) * in);
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(g) * in);
  const bool has_x = g < tokens;
  const int64_t vecs = in / 8;  // 16-byte vectors a row
  // The warp's steps in chunks of kMmaGemvSteps: step i of chunk c is column step
  // warp + kMmaGemvWarps * (c * kMmaGemvSteps + i); lane q's vector of step s is 4 s + q.
  const int64_t steps = (vecs + 3) / 4;
  const int64_t mine = steps > warp ? (steps - warp + kMmaGemvWarps - 1) / kMmaGemvWarps : 0;
  const int64_t chunks = (mine + kMmaGemvSteps - 1) / kMmaGemvSteps;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto vec_of = [&](int64_t c, int i) {  // -1: past the row
    const int64_t k = c * kMmaGemvSteps + i;
    const int64_t v = 4 * (warp + kMmaGemvWarps * k) + q;
    return k < mine && v < vecs ? v : -1;
  };
  uint4 cur_a[kMmaGemvSteps], cur_b[kMmaGemvSteps], cur_x[kMmaGemvSteps];
  auto load_w = [&](int64_t c, uint4(&a)[kMmaGemvSteps], uint4(&b)[kMmaGemvSteps]) {
#pragma unroll
    for (int i = 0; i < kMmaGemvSteps; ++i) {
      const int64_t v = vec_of(c, i);
      a[i] = v >= 0 ? __ldcs(wa + v) : zero;
      b[i] = v >= 0 ? __ldcs(wb + v) : zero;
    }
  };
  auto load_x = [&](int64_t c, uint4(&xv)[kMmaGemvSteps]) {
#pragma unroll
    for (int i = 0; i < kMmaGemvSteps; ++i) {
      const int64_t v = vec_of(c, i);
      xv[i] = has_x && v >= 0 ? xr[v] : zero;
    }
  };
  // The first weights are in flight while the kernel before (which writes x) finishes.
  if (chunks > 0) load_w(0, cur_a, cur_b);
  PriorGridsDone();
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (chunks > 0) load_x(0, cur_x);
  for (int64_t c = 0; c < chunks; ++c) {
    uint4 next_a[kMmaGemvSteps], next_b[kMmaGemvSteps], next_x[kMmaGemvSteps];
    const bool more = c + 1 < chunks;
    if (more) {
      load_w(c + 1, next_a, next_b);
      load_x(c + 1, next_x);
    }
#pragma unroll
    for (int i = 0; i < kMmaGemvSteps; ++i) MmaGemvStep<T>(cur_a[i], cur_b[i], cur_x[i], d);
    if (more) {
#pragma unroll
      for (int i = 0; i < kMmaGemvSteps; ++i) {
        cur_a[i] = next_a[i];
        cur_b[i] = next_b[i];
        cur_x[i] = next_x[i];
      }
    }
  }
  const float acc[1][4] = {{d[0], d[1], d[2], d[3]}};
  StoreMmaGemvTile<T, TOut, kGemvTokens>(acc, row0, out, tokens, bias, y);
}

// ---- 4-bit integer codes ------------------------------------------------------------------
//
// y[t, n] = sum over runs r of scale(n, r) * sum over the run's columns j of
// (code(n, j) - zero(n, r)) * x[t, j] (+ bias[n]), as QuantizedGemvWideKernel, for 4-bit integer
// codes whose zeros are integers in [0, 2^e) (HalfMagicBits: e = 7 for bf16 x, 10 for f16),
// runs of whole 128-column chunks, x in the stored column order, up to kQuantizedGemvTokens
// tokens.
//
// Why: the CUDA-core kernel spends a code's extraction, a conversion, a subtraction and an FMA
// per token on every weight; on the H100 that held GPTQ-shaped 4-bit decode of the 8B shape at
// 1.06x bf16's speed (session 33, nf4), where the bytes allow 3.5x. Here two codes become an
// exact operand pair in two integer operations and one paired subtraction, and the mma does the
// products.
//
// Layout. A block takes 16 rows; lane l (g = l / 4, q = l % 4) loads 16 bytes of codes of rows
// g and g + 8: columns 32q .. 32q + 31 of a 128-column chunk. Its word s (columns
// 32q + 8s .. 32q + 8s + 7, code i in nibble i) feeds step s's two mmas: (nibble j, nibble
// j + 4), masked into the mantissas of T's magic value, is the pair (magic + code) for one
// AND-OR, less (magic + zero) exactly; the first mma takes pairs j = 0, 1 (registers 0 and 2;
// rows g and g + 8 in registers 0-1 and 2-3), the second j = 2, 3. x's 16 bytes at the same
// columns are permuted (PRMT) into the same pairs, so each product pairs a weight with its own
// column, and a chunk's 4 steps cover its 128 columns. Every mma sums columns of one chunk, so
// of one run: each chunk's sums are scaled into the row's sums. Lanes past the row's end load
// zero codes and zero x; rows past `out` re-read the last row and are not stored.
//
// Order of the sums: as MmaGemvKernel, with chunks in place of steps. Tokens 8-15 take a second
// mma on the same A registers (kTokens 16), so a token's outputs are the same bits alone or
// among up to 16 tokens, in either kernel.
constexpr int kMmaQuantChunkCols = 128;  // columns a chunk: 4 lanes x 16 bytes of 4-bit codes
constexpr int kMmaQuantAhead = 2;        // chunks whose codes a warp loads at a time
static_assert(kQuantizedGemvTokens == 16, "two mmas of 8 tokens");

// Pairs j = 0..3 of one code word less the run's zero: nibbles (j, j + 4) as T halves.
template <typename T>
__device__ __forceinline__ void CodePairs(uint32_t word, uint32_t magic2, uint32_t zero2,
                                          uint32_t (&pairs)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    pairs[j] = SubHalves<T>(((word >> (4 * j)) & 0x000F000Fu) | magic2, zero2);
  }
}

template <typename T, typename TOut, int kTokens>
__global__ void __launch_bounds__(kMmaGemvWarps * 32)
    MmaQuantGemvKernel(const uint8_t* codes, int64_t code_row, const float* scales,
                       const float* zeros, int64_t runs, const int32_t* block_run, int64_t out,
                       int64_t in, const T* x, int tokens, const T* bias, TOut* y) {
  static_assert(kTokens == kGemvTokens || kTokens == kQuantizedGemvTokens, "8 or 16 tokens");
  constexpr int kHalves = kTokens / kGemvTokens;  // x rows a lane: tokens g (and g + 8)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMmaGemvRows;
  const int64_t rows[2] = {min(row0 + g, out - 1), min(row0 + g + 8, out - 1)};
  const uint4* ca = reinterpret_cast<const uint4*>(codes + rows[0] * code_row);
  const uint4* cb = reinterpret_cast<const uint4*>(codes + rows[1] * code_row);
  const int64_t vecs = code_row / 16;  // 32 columns each
  const int64_t chunks = (vecs + 3) / 4;
  // The warp's chunks: its k-th is chunk warp + kMmaGemvWarps * k; lane q's vector of chunk c
  // is 4 c + q.
  const int64_t mine = chunks > warp ? (chunks - warp + kMmaGemvWarps - 1) / kMmaGemvWarps : 0;
  const int64_t groups = (mine + kMmaQuantAhead - 1) / kMmaQuantAhead;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto vec_of = [&](int64_t k) {  // -1: past the row
    const int64_t v = 4 * (warp + kMmaGemvWarps * k) + q;
    return k < mine && v < vecs ? v : -1;
  };
  auto load = [&](int64_t group, uint4(&a)[kMmaQuantAhead], uint4(&b)[kMmaQuantAhead]) {
#pragma unroll
    for (int i = 0; i < kMmaQuantAhead; ++i) {
      const int64_t v = vec_of(group * kMmaQuantAhead + i);
      a[i] = v >= 0 ? __ldcs(ca + v) : zero;
      b[i] = v >= 0 ? __ldcs(cb + v) : zero;
    }
  };
  const T* xr[kHalves];
  bool has_x[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    xr[h] = x + static_cast<int64_t>(g + 8 * h) * in;
    has_x[h] = g + 8 * h < tokens;
  }
  const uint32_t magic = HalfMagicBits<T>();
  const uint32_t magic2 = magic | (magic << 16);
  float acc[kHalves][4] = {};
  uint4 cur_a[kMmaQuantAhead], cur_b[kMmaQuantAhead];
  // The first codes are in flight while the kernel before (which writes x) finishes.
  if (groups > 0) load(0, cur_a, cur_b);
  PriorGridsDone();
  for (int64_t group = 0; group < groups; ++group) {
    uint4 next_a[kMmaQuantAhead], next_b[kMmaQuantAhead];
    const bool more = group + 1 < groups;
    if (more) load(group + 1, next_a, next_b);
#pragma unroll
    for (int i = 0; i < kMmaQuantAhead; ++i) {
      const int64_t k = group * kMmaQuantAhead + i;
      if (k >= mine) break;  // the whole warp
      const int64_t chunk = warp + kMmaGemvWarps * k;
      const int64_t col = chunk * kMmaQuantChunkCols + 32 * q;  // the lane's first column
      const bool valid = vec_of(k) >= 0;
      const int32_t run = block_run[chunk * (kMmaQuantChunkCols / 8)];
      float scale[2];
      uint32_t zero2[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        scale[r] = scales[rows[r] * runs + run];
        const uint32_t z = magic + static_cast<uint32_t>(zeros[rows[r] * runs + run]);
        zero2[r] = z | (z << 16);
      }
      const uint32_t wa[4] = {cur_a[i].x, cur_a[i].y, cur_a[i].z, cur_a[i].w};
      const uint32_t wb[4] = {cur_b[i].x, cur_b[i].y, cur_b[i].z, cur_b[i].w};
      float d[kHalves][4] = {};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t pa[4], pb[4];
        CodePairs<T>(wa[s], magic2, zero2[0], pa);
        CodePairs<T>(wb[s], magic2, zero2[1], pb);
        const uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]};
        const uint32_t a1[4] = {pa[2], pb[2], pa[3], pb[3]};
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          const uint4 xv =
              has_x[h] && valid ? *reinterpret_cast<const uint4*>(xr[h] + col + 8 * s) : zero;
          const uint32_t b0[2] = {__byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632)};
          const uint32_t b1[2] = {__byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632)};
          Mma16816<T>(d[h], a0, b0);
          Mma16816<T>(d[h], a1, b1);
        }
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][e] += scale[e / 2] * d[h][e];
      }
    }
    if (more) {
#pragma unroll
      for (int i = 0; i < kMmaQuantAhead; ++i) {
        cur_a[i] = next_a[i];
        cur_b[i] = next_b[i];
      }
    }
  }
  StoreMmaGemvTile<T, TOut, kTokens>(acc, row0, out, tokens, bias, y);
}

}  // namespace
}  // namespace tgis::kernels::cuda

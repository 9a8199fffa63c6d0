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
// Like gemv.cuh, it needs its includer to provide the CUDA keywords and primitives (uint4,
// __ldcs, PriorGridsDone, Mma16816, FromF32, ToF32) and gemv.cuh's kGemvTokens: the build's
// common.cuh, warp_mma.cuh and gemv.cuh, or tests/unit/warp_emulator.h.
#pragma once

#include <cstdint>

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host.
namespace {

constexpr int kMmaGemvWarps = 8;  // warps sharing one tile of 16 rows
constexpr int kMmaGemvRows = 16;  // output rows a block
constexpr int kMmaGemvSteps = 4;  // 32-column steps whose loads a warp has in flight
static_assert(kGemvTokens == 8, "one mma.m16n8k16 takes 8 tokens");

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
  __shared__ float partial[kMmaGemvWarps][kMmaGemvRows][kGemvTokens];
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
  // Accumulator i of lane (g, q): row g (+ 8 for i >= 2), token 2q + i % 2.
  partial[warp][g][2 * q] = d[0];
  partial[warp][g][2 * q + 1] = d[1];
  partial[warp][g + 8][2 * q] = d[2];
  partial[warp][g + 8][2 * q + 1] = d[3];
  __syncthreads();
  for (int i = threadIdx.x; i < kMmaGemvRows * kGemvTokens; i += kMmaGemvWarps * 32) {
    const int r = i / kGemvTokens, t = i % kGemvTokens;
    const int64_t n = row0 + r;
    if (n >= out || t >= tokens) continue;
    float sum = 0.0f;
    for (int k = 0; k < kMmaGemvWarps; ++k) sum += partial[k][r][t];
    if (bias != nullptr) sum += ToF32(bias[n]);
    y[static_cast<int64_t>(t) * out + n] = FromF32<TOut>(sum);
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

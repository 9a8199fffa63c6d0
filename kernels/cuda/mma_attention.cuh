// Internal: prefill attention on tensor cores (bf16 and f16), FlashAttention-2 style.
//
// One block takes kMmaTileQ query rows of one sequence and one head; each of its four warps owns
// 16 of those rows. The block stages 64 keys and values at a time in shared memory by cp.async,
// the next chunk's keys in flight while this chunk's softmax and P . V run and its values while
// the next scores do (one buffer each: K is free once scored, V once multiplied); each warp
// reads its K and V operands from there with ldmatrix (V transposed on the way), computes its 16 x
// 64 scores with mma.m16n8k16 (f32 accumulators), keeps the online softmax in registers (a row's
// values live in the four lanes of one lane group), rounds the probabilities to the element type
// and multiplies them into the values with mma again: the score fragments are laid out as the next
// product's A operand, so they never leave registers.
//
// A warp's chunk whose keys every one of its rows sees (all but the causal diagonal and a
// window's edge) skips the per-score masks: the same values, without ~a dozen integer operations
// a score that outweighed the tensor cores' work.
//
// Numerics: products of the stored elements summed in f32, softmax in f32, probabilities
// rounded to T (as FlashAttention does) and normalized by the sum of the rounded values, so a
// row's output is a convex combination of its values. Chunks start at the same key for every
// tile of a causal sequence without a window, and a row's arithmetic does not depend on the
// other rows of its tile, so its result is the same whatever batch or tile it falls in.
//
// The including file provides the primitives: CUDA (common.cuh, warp_mma.cuh) in the build, or
// the warp emulator of tests/unit/warp_emulator.h, which runs this same code on the CPU.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host, and the
// two definitions must not meet at link time.
namespace {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaTileQ = 16 * kMmaWarps;  // query rows per block
constexpr int kMmaKeys = 64;               // keys per staged chunk
constexpr int kMmaMaxDim = 128;
// Halves per staged row: 16-byte aligned rows 68 words apart, so the eight 16-byte rows that
// ldmatrix reads for one 8x8 matrix fall in 32 different banks.
constexpr int kMmaStride = kMmaMaxDim + 8;

template <typename T>
__global__ void __launch_bounds__(kMmaThreads)
    MmaAttentionKernel(const AttnParams p, const HeadTerms terms, const T* q, const T* kc,
                       const T* vc, T* out) {
  PriorGridsDone();
  struct alignas(16) Staged {
    T k[kMmaKeys][kMmaStride];
    T v[kMmaKeys][kMmaStride];
    int64_t rows[2][kMmaKeys];  // cache row (slot * Hk + kv head) of each key, by chunk parity
  };
  __shared__ Staged sm;
  auto& k_s = sm.k;
  auto& v_s = sm.v;
  constexpr int kDimChunks = kMmaMaxDim / 16;  // k16 steps of q . k
  constexpr int kDimTiles = kMmaMaxDim / 8;    // n8 tiles of the output
  constexpr int kKeyTiles = kMmaKeys / 8;      // n8 tiles of the scores
  const int h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, quad = lane & 3;  // mma's groupID and threadID_in_group

  Tile tile;
  if (!LocateTile(p, kMmaTileQ, blockIdx.x, &tile)) return;
  const int s = tile.s, q0 = tile.q0, row0 = tile.row0, rows = tile.rows, pos0 = tile.pos0;
  const int ctx = p.context_lens[s];
  const int kvh = h / (p.hq / p.hk);
  const int dim_chunks = p.d / 16, dim_tiles = p.d / 8;

  // This lane's two rows of the warp's 16 (lo: grp, hi: grp + 8), tile-relative.
  const int r_lo = warp * 16 + grp, r_hi = r_lo + 8;
  const int warp_rows = min(16, rows - warp * 16);  // <= 0: the warp has no row
  uint32_t qa[kDimChunks][4];                       // q as mma A fragments
  {
    const T* q_lo = q + (static_cast<int64_t>(q0 + row0 + r_lo) * p.hq + h) * p.d;
    const T* q_hi = q + (static_cast<int64_t>(q0 + row0 + r_hi) * p.hq + h) * p.d;
#pragma unroll
    for (int c = 0; c < kDimChunks; ++c) {
      const int x = c * 16 + 2 * quad;
      const bool in = c < dim_chunks;
      qa[c][0] = in && r_lo < rows ? LoadPair(q_lo + x) : 0u;
      qa[c][1] = in && r_hi < rows ? LoadPair(q_hi + x) : 0u;
      qa[c][2] = in && r_lo < rows ? LoadPair(q_lo + x + 8) : 0u;
      qa[c][3] = in && r_hi < rows ? LoadPair(q_hi + x + 8) : 0u;
    }
  }
  const int k_first = p.window > 0 ? max(0, pos0 - p.window + 1) : 0;
  const int k_last = p.causal ? pos0 + rows : ctx;  // exclusive
  const int warp_last_pos = pos0 + warp * 16 + warp_rows - 1;
  const float slope = p.alibi ? terms.slope[h] : 0.0f;

  // Running max and sum of this lane's two rows (the sum is this lane's share; the four lanes
  // of a group add theirs at the end), and its share of their outputs: o[i][0..1] row lo,
  // dimensions 8i + 2 quad + {0, 1}; o[i][2..3] row hi.
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  float o[kDimTiles][4];
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  const int pieces = p.d / 8;  // 16-byte pieces of a row
  // The cache rows of chunk c0's n keys (plain loads; read by every thread after a barrier).
  auto locate = [&](int c0, int n, int64_t* rows) {
    for (int j = tid; j < n; j += kMmaThreads) rows[j] = CacheRow(p, s, kvh, c0 + j);
  };
  // Copies the n keys (or values) at `rows` into buf by cp.async, one group. Rows past n are
  // zeros: their probabilities are 0, and 0 times a stale value that happens to be inf or NaN
  // would not be.
  auto stage = [&](const T* cache, T(*buf)[kMmaStride], const int64_t* rows, int n) {
    for (int i = tid; i < kMmaKeys * pieces; i += kMmaThreads) {
      const int j = i / pieces, x = (i % pieces) * 8;
      if (j < n) {
        CpAsync16(&buf[j][x], cache + rows[j] * p.d + x);
      } else {
        Zero16(&buf[j][x]);
      }
    }
    CpAsyncCommit();
  };
  if (k_first < k_last) {
    const int n = min(kMmaKeys, k_last - k_first);
    locate(k_first, n, sm.rows[0]);
    __syncthreads();
    stage(kc, k_s, sm.rows[0], n);
    stage(vc, v_s, sm.rows[0], n);
  }
  for (int c0 = k_first, it = 0; c0 < k_last; c0 += kMmaKeys, ++it) {
    const int n = min(kMmaKeys, k_last - c0);
    const int c1 = c0 + kMmaKeys, n1 = c1 < k_last ? min(kMmaKeys, k_last - c1) : 0;
    int64_t* next_rows = sm.rows[(it + 1) & 1];  // chunk it - 1's, whose copies were issued
    if (n1 > 0) locate(c1, n1, next_rows);
    CpAsyncWait<1>();  // this chunk's keys (its values may still be in flight)
    __syncthreads();
    // A warp whose rows all come before this chunk's first key (causal) has nothing to add;
    // the test is the same for all its lanes, as mma needs.
    const bool active = warp_rows > 0 && !(p.causal && c0 > warp_last_pos);
    // Every row of the warp sees every key of the chunk: no masks.
    const int warp_first_pos = pos0 + warp * 16;
    const bool whole = n == kMmaKeys && (!p.causal || c1 - 1 <= warp_first_pos) &&
                       (p.window <= 0 || c0 > warp_first_pos + 15 - p.window);

    float sc[kKeyTiles][4];  // sc[t][0..1]: row lo, keys 8t + 2 quad + {0, 1}; [2..3]: row hi
#pragma unroll
    for (int t = 0; t < kKeyTiles; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
    if (active) {
      // K as B operands, two key tiles a load: lanes 8m..8m+7 address the rows of matrix m,
      // keys 16u + 8 (m / 2) + row at dimensions 16c + 8 (m % 2).
#pragma unroll
      for (int u = 0; u < kKeyTiles / 2; ++u) {
#pragma unroll
        for (int c = 0; c < kDimChunks; ++c) {
          if (c < dim_chunks) {
            uint32_t b[4];
            LdMatrixX4(
                b,
                &k_s[16 * u + ((lane >> 4) & 1) * 8 + (lane & 7)][16 * c + ((lane >> 3) & 1) * 8]);
            const uint32_t lo[2] = {b[0], b[1]}, hi[2] = {b[2], b[3]};
            Mma16816<T>(sc[2 * u], qa[c], lo);
            Mma16816<T>(sc[2 * u + 1], qa[c], hi);
          }
        }
      }
    }
    __syncthreads();  // every warp has read the keys; the next chunk's rows are visible
    if (n1 > 0) stage(kc, k_s, next_rows, n1);  // in flight during the softmax and P . V

    uint32_t pa[kKeyTiles / 2][4];
    if (active) {
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int t = 0; t < kKeyTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 8 * t + 2 * quad + (e & 1), pos = c0 + j;
          const int row = e < 2 ? r_lo : r_hi, qpos = pos0 + row;
          const bool seen = whole || (row < rows && j < n && (!p.causal || pos <= qpos) &&
                                      (p.window <= 0 || pos > qpos - p.window));
          sc[t][e] =
              seen ? ScaledLogit(p, sc[t][e]) + slope * static_cast<float>(pos - qpos) : -INFINITY;
          if (e < 2) {
            mx_lo = fmaxf(mx_lo, sc[t][e]);
          } else {
            mx_hi = fmaxf(mx_hi, sc[t][e]);
          }
        }
      }
      // The four lanes of a group hold the rest of their rows' scores.
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
      // A row that has seen no key yet keeps an empty sum (and no NaN from -inf - -inf).
      const float fix_lo = new_lo == -INFINITY ? 1.0f : expf(m_lo - new_lo);
      const float fix_hi = new_hi == -INFINITY ? 1.0f : expf(m_hi - new_hi);
      m_lo = new_lo;
      m_hi = new_hi;
      // Probabilities rounded to T, packed as the A fragments of P . V: keys 16k..16k+15 are
      // score tiles 2k and 2k + 1, whose accumulator layout is mma's A layout.
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int t = 0; t < kKeyTiles; ++t) {
        T e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float m = i < 2 ? m_lo : m_hi;
          e[i] = FromF32<T>(sc[t][i] == -INFINITY ? 0.0f : expf(sc[t][i] - m));
        }
        sum_lo += ToF32(e[0]) + ToF32(e[1]);
        sum_hi += ToF32(e[2]) + ToF32(e[3]);
        pa[t / 2][(t & 1) * 2] = JoinHalves(e[0], e[1]);
        pa[t / 2][(t & 1) * 2 + 1] = JoinHalves(e[2], e[3]);
      }
      l_lo = l_lo * fix_lo + sum_lo;
      l_hi = l_hi * fix_hi + sum_hi;
#pragma unroll
      for (int i = 0; i < kDimTiles; ++i) {
        o[i][0] *= fix_lo;
        o[i][1] *= fix_lo;
        o[i][2] *= fix_hi;
        o[i][3] *= fix_hi;
      }
    }
    if (n1 > 0) {
      CpAsyncWait<1>();  // this chunk's values (the next keys may still be in flight)
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    if (active) {
      // V as B operands, transposed on the way, two dimension tiles a load: matrix m holds keys
      // 16k + 8 (m % 2) + row at dimensions 16i + 8 (m / 2).
#pragma unroll
      for (int k = 0; k < kKeyTiles / 2; ++k) {
#pragma unroll
        for (int i = 0; i < kDimTiles / 2; ++i) {
          if (2 * i < dim_tiles) {
            uint32_t b[4];
            LdMatrixX4Trans(
                b,
                &v_s[16 * k + ((lane >> 3) & 1) * 8 + (lane & 7)][16 * i + ((lane >> 4) & 1) * 8]);
            const uint32_t lo[2] = {b[0], b[1]}, hi[2] = {b[2], b[3]};
            Mma16816<T>(o[2 * i], pa[k], lo);
            Mma16816<T>(o[2 * i + 1], pa[k], hi);
          }
        }
      }
    }
    __syncthreads();                            // every warp has read the values
    if (n1 > 0) stage(vc, v_s, next_rows, n1);  // in flight during the next chunk's scores
  }

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  l_lo = SoftmaxDenominator(p, terms, h, m_lo, l_lo);
  l_hi = SoftmaxDenominator(p, terms, h, m_hi, l_hi);
  T* o_lo = out + (static_cast<int64_t>(q0 + row0 + r_lo) * p.hq + h) * p.d;
  T* o_hi = out + (static_cast<int64_t>(q0 + row0 + r_hi) * p.hq + h) * p.d;
#pragma unroll
  for (int i = 0; i < kDimTiles; ++i) {
    if (i >= dim_tiles) continue;
    const int x = 8 * i + 2 * quad;
    if (r_lo < rows) {
      o_lo[x] = FromF32<T>(o[i][0] / l_lo);
      o_lo[x + 1] = FromF32<T>(o[i][1] / l_lo);
    }
    if (r_hi < rows) {
      o_hi[x] = FromF32<T>(o[i][2] / l_hi);
      o_hi[x + 1] = FromF32<T>(o[i][3] / l_hi);
    }
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

// Internal: attention of decode rows (and the rows of short chunks) with the query heads of one
// KV head in one block, so that each key and value is read once for all of them (GQA: 4 or 8
// query heads a KV head in Llama-3 and Mistral shapes; MQA models have up to 8 per block),
// with 16-byte loads.
//
// One block takes one query row, one KV head (up to kGroupMax of its query heads) and one key
// partition of p.keys_per_part keys (kKeysPerPart but in benchmarks); longer contexts are split
// over blocks and CombinePartitions joins them (flash-decoding). Partitions start at fixed offsets
// from the row's first visible key, so a row's arithmetic depends on its own context only, not on
// its batch.
//
// Per chunk of keys: lane groups score one key each (a group's lanes hold 16-byte pieces of the
// key, and add their partial dot products for every query head by shuffles); a warp per query
// head runs the online softmax over the chunk; then threads split into key groups times 16-byte
// pieces of the head dimension multiply the probabilities into the values. At the end the key
// groups' sums meet in shared memory. f32 arithmetic throughout.
//
// Keys and values reach the threads one of two ways. Direct: each thread loads its 16-byte
// pieces from global memory, kUnroll at a time. Staged: the block copies them into shared memory
// a stage of kGroupStageBytes at a time (cp.async, the next stage in flight while this one is
// used) and the threads read them from there. Where blocks queue on every SM (decode of large
// batches), direct loads left each thread one 16-byte load in flight (its registers allow no
// more), about 1 MB for the whole H100, which held the kernel at 25-32% of the HBM's bandwidth;
// a stage puts 8 KB a block in flight without registers. Each key's and value's arithmetic is
// the same either way and in the same order, so every variant gives the same bits and
// PagedAttention's choice (by the grid's size) cannot make a row depend on its batch.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host, and the
// two definitions must not meet at link time.
namespace {

constexpr int kGroupThreads = 128;
constexpr int kGroupWarps = kGroupThreads / 32;
constexpr int kGroupMax = 8;      // query heads per block
constexpr int kGroupChunk = 256;  // keys scored at a time
// Keys of one partition: one chunk, so that a batch-1 decode of a few hundred keys still runs
// on a few blocks a KV head (512 had it on one).
constexpr int kKeysPerPart = 256;
// Keys (values) whose loads a thread has in flight when the grid is small enough for one wave
// (GroupedAttentionKernel's kUnroll; PagedAttention chooses). On the H100, batch 1 at 1024 keys:
// 0.104 ms with one load in flight, 0.048 with four and 256-key partitions; but four cost
// registers (204 a thread), and where blocks queue in waves (batch 64 at 4096 keys, 512-key
// partitions) one load ran in 1.145 ms and four in 1.378. The unroll changes no sum's order,
// so both give the same bits and the choice cannot make a row depend on its batch.
constexpr int kGroupUnroll = 4;
constexpr int kGroupMaxDim = 256;
// Bytes of one stage of key or value rows: 32 bf16 rows of 128, 8 f32 rows of 256. Two stages
// sit beside q and the scores within the footprint of the key groups' partial sums (16-bit
// elements; f32's partial sums are half that).
constexpr int kGroupStageBytes = 8192;

// Lanes that share one key or value row: a power of two covering its 16-byte pieces.
__device__ __forceinline__ int LanesForPieces(int pieces, int most) {
  int lanes = 1;
  while (lanes < pieces && lanes < most) lanes <<= 1;
  return lanes;
}

template <typename T, int kUnroll, bool kStaged>
__global__ void __launch_bounds__(kGroupThreads)
    GroupedAttentionKernel(const AttnParams p, const HeadTerms terms, const T* q, const T* kc,
                           const T* vc, T* out, float* part_m, float* part_l, float* part_acc) {
  static_assert(!kStaged || kUnroll == 1, "a staged row is read from shared memory, one a time");
  PriorGridsDone();
  constexpr int kPiece = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
  constexpr int kStageElems = kGroupStageBytes / static_cast<int>(sizeof(T));
  // The loop's buffers, then (after it) the key groups' partial outputs.
  union Shared {
    struct {
      float q[kGroupMax][kGroupMaxDim];
      float scores[kGroupMax][kGroupChunk];
      alignas(16) T stage[2][kStageElems];  // staged rows, [key][dim]
    } loop;
    float partial[kGroupThreads * kPiece * kGroupMax];  // [key group][head][dim]
  };
  __shared__ Shared sm;
  __shared__ int64_t rows_s[kGroupChunk];  // cache row (slot * Hk + kv head) of each key
  __shared__ float m_s[kGroupMax], l_s[kGroupMax], fix_s[kGroupMax];
  const int t = blockIdx.x, part = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = p.hq / p.hk, splits = (group + kGroupMax - 1) / kGroupMax;
  const int kvh = blockIdx.y / splits;
  const int h0 = kvh * group + static_cast<int>(blockIdx.y % splits) * kGroupMax;
  const int heads = min(kGroupMax, kvh * group + group - h0);

  const int s = SequenceOfRow(p, t);
  const int q_len = p.query_start[s + 1] - p.query_start[s];
  if (q_len >= p.tiled_min_rows) return;  // a tiled kernel takes this sequence
  const int qpos = p.context_lens[s] - q_len + (t - p.query_start[s]);
  const int first = p.window > 0 ? max(0, qpos - p.window + 1) : 0;
  const int k_begin = first + part * p.keys_per_part;
  const int k_end = min(p.causal ? qpos + 1 : p.context_lens[s], k_begin + p.keys_per_part);
  const int64_t part_base = (static_cast<int64_t>(t) * p.hq + h0) * p.partitions + part;
  if (k_begin >= k_end) {  // this row needs fewer partitions than the longest one
    if (p.partitions > 1 && tid < heads) {
      part_m[part_base + tid * p.partitions] = -INFINITY;
      part_l[part_base + tid * p.partitions] = 0.0f;
    }
    return;
  }
  for (int i = tid; i < heads * p.d; i += kGroupThreads)
    sm.loop.q[i / p.d][i % p.d] = ToF32(q[(static_cast<int64_t>(t) * p.hq + h0) * p.d + i]);
  if (tid < kGroupMax) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }

  const int pieces = p.d / kPiece;
  // Scoring: `score_lanes` lanes a key (each `piece_steps` pieces apart), keys_per_warp keys
  // a warp at a time.
  const int score_lanes = LanesForPieces(pieces, 32);
  const int keys_per_warp = 32 / score_lanes, piece_steps = (pieces + 31) / 32;
  // Values: `value_lanes` threads a key (a piece each), key groups of them over the keys.
  const int value_lanes = LanesForPieces(pieces, kGroupThreads);
  const int key_groups = kGroupThreads / value_lanes;
  const int vpiece = tid % value_lanes, kgroup = tid / value_lanes;
  const int stage_keys = kStageElems / p.d;  // rows a stage holds
  float acc[kGroupMax][kPiece];
#pragma unroll
  for (int g = 0; g < kGroupMax; ++g) {
#pragma unroll
    for (int e = 0; e < kPiece; ++e) acc[g][e] = 0.0f;
  }

  // Keys [lo, hi) of the chunk scored into sm.loop.scores; row(j) is key j's row (global or
  // staged). Each key's sum is its lane group's, in the same order whichever warp takes it.
  auto score = [&](int c0, int lo, int hi, auto row) {
    const int key_stride = kGroupWarps * keys_per_warp;  // keys between a group's keys
    // kUnroll keys a lane group at a time: their loads are issued before any is used (see
    // kGroupUnroll). The loop bound is the same for a whole warp: every lane reaches the
    // shuffles.
    for (int base = lo + warp * keys_per_warp; base < hi; base += kUnroll * key_stride) {
      const int sub = lane % score_lanes;
      int j[kUnroll];
      float dot[kUnroll][kGroupMax];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        j[u] = base + u * key_stride + lane / score_lanes;
#pragma unroll
        for (int g = 0; g < kGroupMax; ++g) dot[u][g] = 0.0f;
      }
      for (int step = 0; step < piece_steps; ++step) {
        const int piece = sub + step * score_lanes;
        if (piece >= pieces) continue;
        alignas(16) T kv[kUnroll][kPiece];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (j[u] < hi) Copy16(kv[u], row(j[u]) + piece * kPiece);
        }
#pragma unroll
        for (int g = 0; g < kGroupMax; ++g) {
          if (g >= heads) break;
#pragma unroll
          for (int e = 0; e < kPiece; ++e) {
            const float qv = sm.loop.q[g][piece * kPiece + e];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              if (j[u] < hi) dot[u][g] += qv * ToF32(kv[u][e]);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < kGroupMax; ++g) {
          if (g >= heads) break;  // the same for every lane
          for (int o = score_lanes / 2; o > 0; o >>= 1)
            dot[u][g] += __shfl_xor_sync(0xffffffffu, dot[u][g], o);
        }
        if (sub == 0 && j[u] < hi) {
          for (int g = 0; g < heads; ++g) {
            sm.loop.scores[g][j[u]] =
                ScaledLogit(p, dot[u][g]) +
                (p.alibi ? terms.slope[h0 + g] * static_cast<float>(c0 + j[u] - qpos) : 0.0f);
          }
        }
      }
    }
  };
  // Values of keys [lo, hi) into acc: a thread takes the keys of its key group, in ascending
  // order whatever the ranges, kUnroll loads in flight (see score).
  auto add_values = [&](int lo, int hi, auto row) {
    if (vpiece >= pieces) return;
    for (int j0 = lo + (kgroup - lo % key_groups + key_groups) % key_groups; j0 < hi;
         j0 += kUnroll * key_groups) {
      alignas(16) T vv[kUnroll][kPiece];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * key_groups;
        if (j < hi) Copy16(vv[u], row(j) + vpiece * kPiece);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * key_groups;
        if (j >= hi) break;
#pragma unroll
        for (int g = 0; g < kGroupMax; ++g) {
          if (g >= heads) break;
          const float pj = sm.loop.scores[g][j];
#pragma unroll
          for (int e = 0; e < kPiece; ++e) acc[g][e] += pj * ToF32(vv[u][e]);
        }
      }
    }
  };
  // Copies rows [lo, hi) of the chunk from `cache` into stage `buf` (cp.async, one group).
  auto stage = [&](const T* cache, int lo, int hi, int buf) {
    for (int i = tid; i < (hi - lo) * pieces; i += kGroupThreads) {
      const int key = i / pieces, piece = i % pieces;
      CpAsync16(&sm.loop.stage[buf][key * p.d + piece * kPiece],
                cache + rows_s[lo + key] * p.d + piece * kPiece);
    }
    CpAsyncCommit();
  };
  // use(lo, hi, row) over the chunk's n keys a stage at a time, the next stage's copies in
  // flight meanwhile; the first stage was issued by the caller.
  auto staged = [&](const T* cache, int n, auto use) {
    for (int lo = 0, buf = 0; lo < n; lo += stage_keys, buf ^= 1) {
      const int hi = min(n, lo + stage_keys);
      if (hi < n) {
        stage(cache, hi, min(n, hi + stage_keys), buf ^ 1);
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();  // every thread's copies of this stage have landed
      const T* base = sm.loop.stage[buf];
      use(lo, hi, [&](int j) { return base + (j - lo) * p.d; });
      __syncthreads();  // this stage is read before it is refilled
    }
  };

  for (int c0 = k_begin; c0 < k_end; c0 += kGroupChunk) {
    const int n = min(kGroupChunk, k_end - c0);
    __syncthreads();  // q and the running max are written; the previous chunk's readers are done
    for (int j = tid; j < n; j += kGroupThreads) rows_s[j] = CacheRow(p, s, kvh, c0 + j);
    __syncthreads();
    if constexpr (kStaged) {
      stage(kc, 0, min(n, stage_keys), 0);
      staged(kc, n, [&](int lo, int hi, auto row) { score(c0, lo, hi, row); });
      stage(vc, 0, min(n, stage_keys), 0);  // in flight during the softmax
    } else {
      score(c0, 0, n, [&](int j) { return kc + rows_s[j] * p.d; });
    }
    __syncthreads();
    // Online softmax, a warp per query head.
    for (int g = warp; g < heads; g += kGroupWarps) {
      float mx = -INFINITY;
      for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sm.loop.scores[g][j]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_s[g], mx);  // finite: every key here is visible
      float sum = 0.0f;
      for (int j = lane; j < n; j += 32) {
        const float e = expf(sm.loop.scores[g][j] - m_new);
        sm.loop.scores[g][j] = e;
        sum += e;
      }
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();  // every lane has read m_s[g] before lane 0 moves it
      if (lane == 0) {
        const float fix = expf(m_s[g] - m_new);  // 0 for the first chunk
        fix_s[g] = fix;
        l_s[g] = l_s[g] * fix + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();
    // Values.
#pragma unroll
    for (int g = 0; g < kGroupMax; ++g) {
      const float fix = g < heads ? fix_s[g] : 0.0f;
#pragma unroll
      for (int e = 0; e < kPiece; ++e) acc[g][e] *= fix;
    }
    if constexpr (kStaged) {
      staged(vc, n, add_values);
    } else {
      add_values(0, n, [&](int j) { return vc + rows_s[j] * p.d; });
    }
  }

  __syncthreads();  // the loop's buffers become the partial sums
  if (vpiece < pieces) {
    for (int g = 0; g < heads; ++g) {
#pragma unroll
      for (int e = 0; e < kPiece; ++e)
        sm.partial[(kgroup * heads + g) * p.d + vpiece * kPiece + e] = acc[g][e];
    }
  }
  __syncthreads();
  for (int i = tid; i < heads * p.d; i += kGroupThreads) {
    const int g = i / p.d, x = i % p.d;
    float sum = 0.0f;
    for (int k = 0; k < key_groups; ++k) sum += sm.partial[(k * heads + g) * p.d + x];
    if (p.partitions == 1) {
      out[(static_cast<int64_t>(t) * p.hq + h0 + g) * p.d + x] =
          FromF32<T>(sum / SoftmaxDenominator(p, terms, h0 + g, m_s[g], l_s[g]));
    } else {
      part_acc[(part_base + g * p.partitions) * p.d + x] = sum;
    }
  }
  if (p.partitions > 1 && tid < heads) {
    part_m[part_base + tid * p.partitions] = m_s[tid];
    part_l[part_base + tid * p.partitions] = l_s[tid];
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

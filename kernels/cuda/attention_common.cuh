// Internal: what the CUDA attention kernels of a paged batch share: their parameters and the
// row/tile bookkeeping. Like the kernels in mma_attention.cuh and grouped_attention.cuh, it
// needs its includer to provide the CUDA keywords: common.cuh in the build, or the warp
// emulator of tests/unit/warp_emulator.h, under which a test runs those kernels on the CPU.
#pragma once

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host, and the
// two definitions must not meet at link time.
namespace {

constexpr int kMaxAttentionHeads = 256;

// What each query head adds to its softmax: an ALiBi slope (AttnParams::alibi) and an
// attention sink (AttnParams::sinks, AttentionBias::sinks).
struct HeadTerms {
  float slope[kMaxAttentionHeads];
  float sink[kMaxAttentionHeads];
};

struct AttnParams {
  const int* query_start;
  const int* context_lens;
  const int* tables;
  int max_blocks, num_seqs, block_size;
  int hq, hk, d;
  float scale;
  float softcap;  // > 0: AttentionBias::softcap
  int window;
  bool alibi;
  bool sinks;  // HeadTerms::sink: one more logit in each head's softmax denominator
  bool causal;
  const float* relative;  // [hq, num_buckets] or null
  int num_buckets, max_distance;
  bool bidirectional;
  int partitions;     // blocks along the keys of one (row, head)
  int keys_per_part;  // keys each of them covers (in chunks of kChunk)
  // Sequences with at least this many query rows go to a tiled kernel, the others to the
  // per-row one: the choice is the sequence's own, whatever else is in the batch, so a
  // request's result does not depend on its batch. A huge value: no tiled kernel runs.
  int tiled_min_rows;
};

// q.k scaled, through the soft cap when there is one (Gemma 2: tanh(logit / cap) * cap, before
// any bias, as transformers applies it).
__device__ __forceinline__ float ScaledLogit(const AttnParams& p, float dot) {
  const float s = dot * p.scale;
  return p.softcap > 0 ? tanhf(s / p.softcap) * p.softcap : s;
}

// What a row of head h divides its sum of p * v by: its sum of p, l, at its running maximum m,
// with the head's attention sink joined when there are sinks (exp(sink - m) may overflow when
// the sink dwarfs every score: the output is then 0, the limit it tends to).
__device__ __forceinline__ float SoftmaxDenominator(const AttnParams& p, const HeadTerms& terms,
                                                    int h, float m, float l) {
  return p.sinks ? l + expf(terms.sink[h] - m) : l;
}

// The cache row (slot * Hk + kv head) of sequence s's key at position pos, through its block
// table.
__device__ __forceinline__ int64_t CacheRow(const AttnParams& p, int s, int kvh, int pos) {
  const int block = p.tables[static_cast<int64_t>(s) * p.max_blocks + pos / p.block_size];
  return (static_cast<int64_t>(block) * p.block_size + pos % p.block_size) * p.hk + kvh;
}

// The sequence that owns query row t: query_start[s] <= t < query_start[s + 1].
__device__ __forceinline__ int SequenceOfRow(const AttnParams& p, int t) {
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.query_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A tiled kernel's block: `tile_rows` query rows of one sequence (of those with at least
// p.tiled_min_rows rows, cut into tiles in order). The grid is an upper bound: a block past the
// last tile has none (LocateTile returns false).
struct Tile {
  int s;      // the sequence
  int q0;     // the batch row of its first query
  int q_len;  // its query rows
  int row0;   // the tile's first row within them
  int rows;   // the tile's rows (the last tile of a sequence may be partial)
  int pos0;   // the position of the tile's first row
};
__device__ __forceinline__ bool LocateTile(const AttnParams& p, int tile_rows, int block, Tile* t) {
  int s = 0;
  for (; s < p.num_seqs; ++s) {
    const int len = p.query_start[s + 1] - p.query_start[s];
    if (len < p.tiled_min_rows) continue;
    const int tiles = (len + tile_rows - 1) / tile_rows;
    if (block < tiles) break;
    block -= tiles;
  }
  if (s == p.num_seqs) return false;
  t->s = s;
  t->q0 = p.query_start[s];
  t->q_len = p.query_start[s + 1] - t->q0;
  t->row0 = block * tile_rows;
  t->rows = min(tile_rows, t->q_len - t->row0);
  t->pos0 = p.context_lens[s] - t->q_len + t->row0;
  return true;
}

// Combines the partitions of one (row, head): rescale each by exp(m_p - max) and normalize
// (an attention sink joins the denominator here, once).
// Rows of the sequences a tiled kernel takes are left to it.
template <typename T>
__global__ void CombinePartitionsKernel(const AttnParams p, const HeadTerms terms,
                                        const float* part_m, const float* part_l,
                                        const float* part_acc, T* out) {
  PriorGridsDone();
  const int row = blockIdx.x, hq = p.hq, d = p.d, partitions = p.partitions;
  const int s = SequenceOfRow(p, row);
  if (p.query_start[s + 1] - p.query_start[s] >= p.tiled_min_rows) return;
  const int64_t base = static_cast<int64_t>(row) * hq + blockIdx.y;
  const float* m = part_m + base * partitions;
  const float* l = part_l + base * partitions;
  float mx = -INFINITY;
  for (int k = 0; k < partitions; ++k) mx = fmaxf(mx, m[k]);
  float total = 0;
  for (int k = 0; k < partitions; ++k) {
    if (m[k] != -INFINITY) total += l[k] * expf(m[k] - mx);
  }
  total = SoftmaxDenominator(p, terms, blockIdx.y, mx, total);
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0;
    for (int k = 0; k < partitions; ++k) {
      if (m[k] != -INFINITY) acc += part_acc[(base * partitions + k) * d + i] * expf(m[k] - mx);
    }
    out[base * d + i] = FromF32<T>(acc / total);
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

// Internal: what the CUDA attention kernels of a paged batch share. Plain structs and index
// arithmetic, so that the tensor-core prefill kernel (mma_attention.cuh) also compiles on the
// host, where a test runs it under a warp emulator.
#pragma once

namespace tgis::kernels::cuda {

constexpr int kMaxAttentionHeads = 256;

struct Slopes {
  float v[kMaxAttentionHeads];
};

struct AttnParams {
  const int* query_start;
  const int* context_lens;
  const int* tables;
  int max_blocks, num_seqs, block_size;
  int hq, hk, d;
  float scale;
  int window;
  bool alibi;
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

}  // namespace tgis::kernels::cuda

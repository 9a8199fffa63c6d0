// The paged KV cache on CUDA: writing new keys/values into their slots, and attention of a
// ragged batch (prefill and decode rows alike) over the cache.
//
// A sequence's own query length picks its kernel. Prompts and chunks (kTiledMinRows rows or
// more) go to tiled kernels, which read each staged key once for many rows: on tensor cores
// (mma_attention.cuh) for 16-bit activations, or the f32 one below. Decode rows and short
// chunks go to the grouped kernel (grouped_attention.cuh: the query heads of one KV head in one
// block, 16-byte loads), or, for T5's relative bias and head rows that are not whole 16-byte
// pieces, to the per-row kernel below: one thread block per (query row, head, key partition),
// each warp scoring one key at a time. Both split long contexts into partitions that run in
// parallel, each leaving its softmax max, sum and unnormalized output, and a second kernel
// combines them (flash-decoding), so a single long sequence still fills the GPU. Scores and
// softmax are f32.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/warp_mma.cuh"
#include "kernels/cuda_ops.h"
#include "kernels/relative_position.h"

// After the primitives they use (common.cuh, warp_mma.cuh).
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/grouped_attention.cuh"
#include "kernels/cuda/mma_attention.cuh"

namespace tgis::kernels::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 512;  // keys a block scores at a time
constexpr int kMaxHeadDim = 256;
// Partitions split a long context over blocks; their f32 partial outputs live in a workspace
// of at most this many bytes (a large prefill gets fewer, longer partitions).
constexpr int64_t kWorkspaceBytes = 256ll << 20;

// The grouped kernel's keys per partition: kKeysPerPart, or a benchmark's choice
// (SetGroupedPartitionKeysForTesting).
std::atomic<int> g_grouped_part_keys{kKeysPerPart};
// Whether the grouped kernel stages rows where blocks queue (SetGroupedStagingForTesting).
std::atomic<bool> g_grouped_staging{true};

// The GPU's multiprocessors (one GPU a process).
int SmCount() {
  static const int count = [] {
    BindThread();
    int device = 0, n = 0;
    TGIS_CUDA_CHECK(cudaGetDevice(&device));
    TGIS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return count;
}

template <typename T>
__global__ void ReshapeAndCacheKernel(const T* k, const T* v, const void* slots, bool wide,
                                      int64_t width, T* kc, T* vc) {
  PriorGridsDone();
  const int64_t t = blockIdx.x;
  const int64_t slot = LoadIndex(slots, wide, t);
  if (slot < 0) return;  // a padding row
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    kc[slot * width + i] = k[t * width + i];
    vc[slot * width + i] = v[t * width + i];
  }
}

constexpr int kDimsPerThread = kMaxHeadDim / kThreads;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AttentionKernel(const AttnParams p, const HeadTerms terms, const T* q, const T* kc, const T* vc,
                    T* out, float* part_m, float* part_l, float* part_acc) {
  PriorGridsDone();
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float scores[kChunk];
  __shared__ int64_t rows[kChunk];  // cache row (slot * Hk + kv head) of each key of the chunk
  __shared__ float scratch[32];
  const int t = blockIdx.x, h = blockIdx.y, part = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;

  const int s = SequenceOfRow(p, t);
  const int q_len = p.query_start[s + 1] - p.query_start[s];
  if (q_len >= p.tiled_min_rows) return;  // a tiled kernel takes this sequence
  const int qpos = p.context_lens[s] - q_len + (t - p.query_start[s]);
  const int first = p.window > 0 ? max(0, qpos - p.window + 1) : 0;
  const int k_begin = first + part * p.keys_per_part;
  const int k_end = min(p.causal ? qpos + 1 : p.context_lens[s], k_begin + p.keys_per_part);
  const int64_t part_index = (static_cast<int64_t>(t) * p.hq + h) * p.partitions + part;
  if (k_begin >= k_end) {  // this row needs fewer partitions than the longest one
    if (p.partitions > 1 && tid == 0) {
      part_m[part_index] = -INFINITY;
      part_l[part_index] = 0.0f;
    }
    return;
  }
  const int kvh = h / (p.hq / p.hk);
  const T* qr = q + (static_cast<int64_t>(t) * p.hq + h) * p.d;
  for (int i = tid; i < p.d; i += blockDim.x) q_s[i] = ToF32(qr[i]);
  const float slope = p.alibi ? terms.slope[h] : 0.0f;

  // Online softmax over chunks of keys: running max, running sum, and this thread's output
  // dimensions (tid, tid + kThreads, ...), rescaled whenever the max grows.
  float m_run = -INFINITY, l_run = 0.0f;
  float acc[kDimsPerThread];
#pragma unroll
  for (int r = 0; r < kDimsPerThread; ++r) acc[r] = 0.0f;
  for (int c0 = k_begin; c0 < k_end; c0 += kChunk) {
    const int n = min(kChunk, k_end - c0);
    __syncthreads();  // q_s is written; the previous chunk's readers are done with rows, scores
    for (int j = tid; j < n; j += blockDim.x) rows[j] = CacheRow(p, s, kvh, c0 + j);
    __syncthreads();
    for (int j = warp; j < n; j += warps) {
      const T* kr = kc + rows[j] * p.d;
      float dot = 0;
      for (int i = lane; i < p.d; i += 32) dot += q_s[i] * ToF32(kr[i]);
      dot = WarpSum(dot);
      if (lane == 0) {
        float sc = ScaledLogit(p, dot) + slope * static_cast<float>(c0 + j - qpos);
        if (p.relative != nullptr) {
          sc +=
              p.relative[h * p.num_buckets + RelativePositionBucket(c0 + j - qpos, p.bidirectional,
                                                                    p.num_buckets, p.max_distance)];
        }
        scores[j] = sc;
      }
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int j = tid; j < n; j += blockDim.x) mx = fmaxf(mx, scores[j]);
    const float m_new = fmaxf(m_run, BlockMax(mx, scratch));
    float sum = 0;
    for (int j = tid; j < n; j += blockDim.x) {
      const float e = expf(scores[j] - m_new);
      scores[j] = e;
      sum += e;
    }
    sum = BlockSum(sum, scratch);  // its barriers also publish the scores written above
    const float correction = expf(m_run - m_new);  // 0 for the first chunk
    l_run = l_run * correction + sum;
#pragma unroll
    for (int r = 0; r < kDimsPerThread; ++r) {
      const int i = tid + r * kThreads;
      if (i < p.d) {
        float a = 0;
        for (int j = 0; j < n; ++j) a += scores[j] * ToF32(vc[rows[j] * p.d + i]);
        acc[r] = acc[r] * correction + a;
      }
    }
    m_run = m_new;
  }

#pragma unroll
  for (int r = 0; r < kDimsPerThread; ++r) {
    const int i = tid + r * kThreads;
    if (i >= p.d) continue;
    if (p.partitions == 1) {
      out[(static_cast<int64_t>(t) * p.hq + h) * p.d + i] =
          FromF32<T>(acc[r] / SoftmaxDenominator(p, terms, h, m_run, l_run));
    } else {
      part_acc[part_index * p.d + i] = acc[r];
    }
  }
  if (p.partitions > 1 && tid == 0) {
    part_m[part_index] = m_run;
    part_l[part_index] = l_run;
  }
}

// Prefill rows in tiles: one block takes kTileQ query rows of one sequence and one head, and
// walks the keys in chunks staged in shared memory, so each chunk of keys and values is read
// once per tile rather than once per row (the per-row kernel above read a 2048-token prompt's
// cache 2048 times per head: 420 ms to the first token on the H100 against HF's 62). Warp w
// owns rows 4w..4w+3: lane l scores keys l and l + 32 of the chunk for them, the rows' online
// softmax is a warp reduction, and for the values lane l sums dimensions l, l + 32, l + 64,
// l + 96. f32 arithmetic; a row's chunks start at the tile's first key, which for causal
// attention without a window is 0 for every tile, so a row's result does not depend on the
// batch or the tile it fell in. It takes f32 activations and head sizes that are not multiples
// of 16; 16-bit ones go to the tensor-core kernel of mma_attention.cuh.
constexpr int kTileQ = 16;
// Query rows from which a sequence goes to a tiled kernel (this one or mma_attention.cuh's).
constexpr int kTiledMinRows = 8;
constexpr int kTileThreads = 128;  // 4 warps of 4 rows
constexpr int kTileMaxDim = 128;
constexpr int kTileRowsPerWarp = kTileQ / (kTileThreads / 32);
constexpr int kTileDimsPerLane = kTileMaxDim / 32;

template <typename T>
struct TileShape {
  // 64 keys of 16-bit values, 32 of f32: the chunk's keys and values fit the 48 KB of static
  // shared memory either way.
  static constexpr int kKeys = sizeof(T) == 4 ? 32 : 64;
  // Key rows padded to an odd number of 4-byte words: the lanes of a warp read 32 different
  // keys at one dimension without bank conflicts.
  static constexpr int kStride = kTileMaxDim + 4 / static_cast<int>(sizeof(T));
};

template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    TiledAttentionKernel(const AttnParams p, const HeadTerms terms, const T* q, const T* kc,
                         const T* vc, T* out) {
  PriorGridsDone();
  constexpr int kKeys = TileShape<T>::kKeys, kStride = TileShape<T>::kStride;
  constexpr int kKeysPerLane = kKeys / 32;
  __shared__ float q_s[kTileQ][kTileMaxDim];
  __shared__ T k_s[kKeys][kStride];
  __shared__ T v_s[kKeys][kTileMaxDim];
  __shared__ float p_s[kTileQ][kKeys];
  __shared__ int64_t rows_s[kKeys];
  const int h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  Tile tile;
  if (!LocateTile(p, kTileQ, blockIdx.x, &tile)) return;
  const int s = tile.s, q0 = tile.q0, row0 = tile.row0, rows = tile.rows, pos0 = tile.pos0;
  const int ctx = p.context_lens[s];
  const int kvh = h / (p.hq / p.hk);
  for (int i = tid; i < kTileQ * p.d; i += kTileThreads) {
    const int r = i / p.d, x = i % p.d;
    q_s[r][x] = r < rows ? ToF32(q[(static_cast<int64_t>(q0 + row0 + r) * p.hq + h) * p.d + x]) : 0;
  }
  const int k_first = p.window > 0 ? max(0, pos0 - p.window + 1) : 0;
  const int k_last = p.causal ? pos0 + rows : ctx;  // exclusive
  const float slope = p.alibi ? terms.slope[h] : 0.0f;

  float m_run[kTileRowsPerWarp], l_run[kTileRowsPerWarp];
  float acc[kTileRowsPerWarp][kTileDimsPerLane];
#pragma unroll
  for (int r = 0; r < kTileRowsPerWarp; ++r) {
    m_run[r] = -INFINITY;
    l_run[r] = 0;
#pragma unroll
    for (int x = 0; x < kTileDimsPerLane; ++x) acc[r][x] = 0;
  }
  for (int c0 = k_first; c0 < k_last; c0 += kKeys) {
    const int n = min(kKeys, k_last - c0);
    __syncthreads();  // the previous chunk's readers are done
    for (int j = tid; j < n; j += kTileThreads) rows_s[j] = CacheRow(p, s, kvh, c0 + j);
    __syncthreads();
    for (int i = tid; i < n * p.d; i += kTileThreads) {
      const int j = i / p.d, x = i % p.d;
      k_s[j][x] = kc[rows_s[j] * p.d + x];
      v_s[j][x] = vc[rows_s[j] * p.d + x];
    }
    __syncthreads();
    float sc[kTileRowsPerWarp][kKeysPerLane];
#pragma unroll
    for (int r = 0; r < kTileRowsPerWarp; ++r) {
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) sc[r][k] = 0;
    }
    for (int x = 0; x < p.d; ++x) {
      float kv[kKeysPerLane];
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) kv[k] = ToF32(k_s[lane + 32 * k][x]);
#pragma unroll
      for (int r = 0; r < kTileRowsPerWarp; ++r) {
        const float qv = q_s[warp * kTileRowsPerWarp + r][x];
#pragma unroll
        for (int k = 0; k < kKeysPerLane; ++k) sc[r][k] += qv * kv[k];
      }
    }
#pragma unroll
    for (int r = 0; r < kTileRowsPerWarp; ++r) {
      const int row = warp * kTileRowsPerWarp + r;
      const int qpos = pos0 + row;
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) {
        const int j = lane + 32 * k, pos = c0 + j;
        const bool seen = row < rows && j < n && (!p.causal || pos <= qpos) &&
                          (p.window <= 0 || pos > qpos - p.window);
        sc[r][k] =
            seen ? ScaledLogit(p, sc[r][k]) + slope * static_cast<float>(pos - qpos) : -INFINITY;
        mx = fmaxf(mx, sc[r][k]);
      }
      const float m_new = fmaxf(m_run[r], WarpMax(mx));
      // A row that has seen no key yet keeps an empty sum (and no NaN from -inf - -inf).
      const float correction = m_new == -INFINITY ? 1.0f : expf(m_run[r] - m_new);
      float sum = 0;
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) {
        const float e = sc[r][k] == -INFINITY ? 0.0f : expf(sc[r][k] - m_new);
        p_s[row][lane + 32 * k] = e;
        sum += e;
      }
      l_run[r] = l_run[r] * correction + WarpSum(sum);
      m_run[r] = m_new;
#pragma unroll
      for (int x = 0; x < kTileDimsPerLane; ++x) acc[r][x] *= correction;
    }
    __syncwarp();  // this warp's rows of p_s are written
    for (int j = 0; j < n; ++j) {
      float vv[kTileDimsPerLane];
#pragma unroll
      for (int x = 0; x < kTileDimsPerLane; ++x) {
        const int dim = lane + 32 * x;
        vv[x] = dim < p.d ? ToF32(v_s[j][dim]) : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kTileRowsPerWarp; ++r) {
        const float pj = p_s[warp * kTileRowsPerWarp + r][j];
#pragma unroll
        for (int x = 0; x < kTileDimsPerLane; ++x) acc[r][x] += pj * vv[x];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kTileRowsPerWarp; ++r) {
    const int row = warp * kTileRowsPerWarp + r;
    if (row >= rows) continue;
    T* o = out + (static_cast<int64_t>(q0 + row0 + row) * p.hq + h) * p.d;
    const float denominator = SoftmaxDenominator(p, terms, h, m_run[r], l_run[r]);
#pragma unroll
    for (int x = 0; x < kTileDimsPerLane; ++x) {
      const int dim = lane + 32 * x;
      if (dim < p.d) o[dim] = FromF32<T>(acc[r][x] / denominator);
    }
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void CheckCudaI32(const Tensor& t, const char* op, const char* what) {
  TGIS_CHECK(t.defined() && t.device() == Device::kCuda && t.dtype() == DType::kI32,
             "%s: %s must be a CUDA i32 tensor", op, what);
}

}  // namespace

void ReshapeAndCache(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                     KvCacheLayer* cache) {
  const char* op = "ReshapeAndCache";
  CheckCudaFloat(k, op, "k");
  CheckCudaIndex(slot_mapping, op, "slot_mapping");
  TGIS_CHECK(k.rank() == 3 && k.shape() == v.shape() && k.dtype() == v.dtype(),
             "%s: k and v must be [T, Hk, D] of one dtype", op);
  CheckCache(*cache, k.dtype(), op);
  TGIS_CHECK(cache->k.dim(2) == k.dim(1) && cache->k.dim(3) == k.dim(2),
             "%s: cache heads/head_dim differ from k's", op);
  const int64_t t = k.dim(0), width = k.dim(1) * k.dim(2);
  TGIS_CHECK(slot_mapping.numel() == t, "%s: slot_mapping has %lld entries, want %lld", op,
             static_cast<long long>(slot_mapping.numel()), static_cast<long long>(t));
  if (t == 0) return;
  TGIS_DISPATCH_FLOAT(
      k.dtype(), op,
      Launch(ReshapeAndCacheKernel<T>, static_cast<unsigned>(t), RowThreads(width), k.data<T>(),
             v.data<T>(), slot_mapping.raw(), slot_mapping.dtype() == DType::kI64, width,
             cache->k.data<T>(), cache->v.data<T>()));
}

void SetGroupedStagingForTesting(bool on) {
  g_grouped_staging.store(on, std::memory_order_relaxed);
}

void SetGroupedPartitionKeysForTesting(int keys) {
  g_grouped_part_keys.store(keys > 0 ? keys : kKeysPerPart, std::memory_order_relaxed);
}

void PagedAttention(const Tensor& q, const KvCacheLayer& cache, const AttentionBatch& batch,
                    float scale, int sliding_window, const AttentionBias* bias, Tensor* out) {
  const char* op = "PagedAttention";
  CheckCudaFloat(q, op, "q");
  CheckCache(cache, q.dtype(), op);
  CheckCudaI32(batch.query_start, op, "query_start");
  CheckCudaI32(batch.context_lens, op, "context_lens");
  CheckCudaI32(batch.block_tables, op, "block_tables");
  TGIS_CHECK(q.rank() == 3, "%s: q must be [T, Hq, D]", op);
  const int64_t t = q.dim(0), hq = q.dim(1), d = q.dim(2), hk = cache.k.dim(2);
  TGIS_CHECK(cache.k.dim(3) == d && hq % hk == 0, "%s: head_dim or head counts disagree", op);
  TGIS_CHECK(d <= kMaxHeadDim && hq <= kMaxAttentionHeads,
             "%s: head_dim %lld / %lld heads unsupported", op, static_cast<long long>(d),
             static_cast<long long>(hq));
  const int64_t num_seqs = batch.context_lens.numel();
  TGIS_CHECK(batch.query_start.numel() == num_seqs + 1 && batch.block_tables.rank() == 2 &&
                 batch.block_tables.dim(0) == num_seqs,
             "%s: batch metadata sizes disagree", op);
  TGIS_CHECK(cache.k.dim(1) == batch.block_size, "%s: cache block size is not the batch's", op);
  const std::vector<float>* alibi_slopes = bias != nullptr ? &bias->alibi_slopes : nullptr;
  const bool alibi = alibi_slopes != nullptr && !alibi_slopes->empty();
  const bool relative = bias != nullptr && bias->relative_table.defined();
  if (relative) {
    TGIS_CHECK(bias->relative_table.device() == Device::kCuda &&
                   bias->relative_table.dtype() == DType::kF32 &&
                   bias->relative_table.rank() == 2 && bias->relative_table.dim(0) == hq &&
                   bias->relative_table.dim(1) == bias->num_buckets && bias->num_buckets >= 2 &&
                   bias->max_distance > 0,
               "%s: relative_table must be a CUDA f32 [Hq, num_buckets]", op);
  }
  TGIS_CHECK(batch.causal || sliding_window <= 0, "%s: a sliding window needs causal attention",
             op);
  const bool sinks = bias != nullptr && !bias->sinks.empty();
  TGIS_CHECK(!sinks || static_cast<int64_t>(bias->sinks.size()) == hq,
             "%s: %zu attention sinks for %lld heads", op, sinks ? bias->sinks.size() : 0,
             static_cast<long long>(hq));
  TGIS_CHECK(!alibi || static_cast<int64_t>(alibi_slopes->size()) == hq,
             "%s: %zu ALiBi slopes for %lld heads", op, alibi ? alibi_slopes->size() : 0,
             static_cast<long long>(hq));
  PrepareOut(out, q.shape(), q.dtype(), op);
  if (t == 0 || num_seqs == 0) return;

  AttnParams p{batch.query_start.data<int>(),
               batch.context_lens.data<int>(),
               batch.block_tables.data<int>(),
               static_cast<int>(batch.block_tables.dim(1)),
               static_cast<int>(num_seqs),
               batch.block_size,
               static_cast<int>(hq),
               static_cast<int>(hk),
               static_cast<int>(d),
               scale,
               bias != nullptr ? bias->softcap : 0.0f,
               sliding_window,
               alibi,
               sinks,
               batch.causal,
               relative ? bias->relative_table.data<float>() : nullptr,
               relative ? bias->num_buckets : 0,
               relative ? bias->max_distance : 0,
               relative && bias->bidirectional,
               /*partitions=*/1,
               /*keys_per_part=*/1,
               /*tiled_min_rows=*/0};
  HeadTerms terms{};
  if (alibi) std::copy(alibi_slopes->begin(), alibi_slopes->end(), terms.slope);
  if (sinks) std::copy(bias->sinks.begin(), bias->sinks.end(), terms.sink);

  // Sequences of kTiledMinRows or more query rows (prompts, chunks) take a tiled kernel: on
  // tensor cores for 16-bit activations and head sizes in multiples of 16 up to 128, in f32
  // otherwise; T5's relative bias and head sizes over 128 stay on the per-row kernel, as do
  // decode rows. The caller's hints on query lengths spare launches that would find nothing to
  // do; without them the bounds come from the row and sequence counts.
  const int64_t longest = batch.max_query_len > 0 ? batch.max_query_len : t - (num_seqs - 1);
  const int64_t shortest = batch.min_query_len > 0 ? batch.min_query_len : (num_seqs == 1 ? t : 1);
  const bool tiled = !relative && d <= kTileMaxDim && longest >= kTiledMinRows;
  p.tiled_min_rows = tiled ? kTiledMinRows : std::numeric_limits<int>::max();
  if (tiled) {
    const bool mma = q.dtype() != DType::kF32 && d % 16 == 0 && Aligned(q.raw(), 4) &&
                     Aligned(cache.k.raw(), 16) && Aligned(cache.v.raw(), 16);
    const int tile_rows = mma ? kMmaTileQ : kTileQ;
    // At most t / tile_rows + num_seqs tiles: each sequence's last one may be partial.
    const dim3 grid(static_cast<unsigned>((t + tile_rows - 1) / tile_rows + num_seqs),
                    static_cast<unsigned>(hq));
    if (mma) {
      if (q.dtype() == DType::kBF16) {
        Launch(MmaAttentionKernel<bf16>, grid, kMmaThreads, p, terms, q.data<bf16>(),
               cache.k.data<bf16>(), cache.v.data<bf16>(), out->data<bf16>());
      } else {
        Launch(MmaAttentionKernel<f16>, grid, kMmaThreads, p, terms, q.data<f16>(),
               cache.k.data<f16>(), cache.v.data<f16>(), out->data<f16>());
      }
    } else {
      TGIS_DISPATCH_FLOAT(q.dtype(), op,
                          Launch(TiledAttentionKernel<T>, grid, kTileThreads, p, terms, q.data<T>(),
                                 cache.k.data<T>(), cache.v.data<T>(), out->data<T>()));
    }
    if (shortest >= kTiledMinRows) return;
  }

  // Launch sizes come from the longest context; read it back only when the caller did not
  // say (tests do not; the engine does, so steps do not synchronize here).
  int64_t max_context = batch.max_context_len;
  if (max_context <= 0) {
    std::vector<int32_t> lens(num_seqs);
    Copy(lens.data(), Device::kCpu, batch.context_lens.raw(), Device::kCuda,
         num_seqs * sizeof(int32_t));
    max_context = *std::max_element(lens.begin(), lens.end());
  }
  const int64_t keys =
      sliding_window > 0 ? std::min<int64_t>(max_context, sliding_window) : max_context;
  const int64_t per_partition = t * hq * d * static_cast<int64_t>(sizeof(float));
  const int64_t cap = std::max<int64_t>(1, kWorkspaceBytes / std::max<int64_t>(1, per_partition));
  // The grouped kernel (one block for the query heads of a KV head, 16-byte loads) takes rows
  // whose 16-bit or f32 head rows are whole 16-byte pieces, in partitions of a fixed size; the
  // per-row kernel the rest (T5's relative bias, odd head sizes, partition counts past the
  // workspace), in partitions sized by the longest context.
  const int part_keys = g_grouped_part_keys.load(std::memory_order_relaxed);
  const int64_t grouped_partitions = (keys + part_keys - 1) / part_keys;
  const bool grouped = !relative && d * static_cast<int64_t>(DTypeSize(q.dtype())) % 16 == 0 &&
                       d <= kGroupMaxDim && Aligned(cache.k.raw(), 16) &&
                       Aligned(cache.v.raw(), 16) && grouped_partitions <= cap;
  const int partitions =
      grouped ? static_cast<int>(std::max<int64_t>(1, grouped_partitions))
              : static_cast<int>(std::clamp<int64_t>((keys + kChunk - 1) / kChunk, 1, cap));
  p.partitions = partitions;
  p.keys_per_part =
      grouped ? part_keys : std::max(1, static_cast<int>((keys + partitions - 1) / partitions));
  Tensor m, l, acc;
  if (partitions > 1) {
    m = Tensor::Empty({t, hq, partitions}, DType::kF32, Device::kCuda);
    l = Tensor::Empty({t, hq, partitions}, DType::kF32, Device::kCuda);
    acc = Tensor::Empty({t, hq, partitions, d}, DType::kF32, Device::kCuda);
  }
  if (grouped) {
    const int64_t splits = (hq / hk + kGroupMax - 1) / kGroupMax;
    const dim3 grid(static_cast<unsigned>(t), static_cast<unsigned>(hk * splits),
                    static_cast<unsigned>(partitions));
    // Four direct loads in flight a thread where the grid fits in about one wave (two blocks an
    // SM at its registers, kGroupUnroll); staged rows where blocks queue (or, for benchmarks,
    // one direct load): the same bits every way.
    const bool one_wave = static_cast<int64_t>(grid.x) * grid.y * grid.z <= 2 * SmCount();
    const bool staged = g_grouped_staging.load(std::memory_order_relaxed);
    TGIS_DISPATCH_FLOAT(q.dtype(), op, {
      auto kernel = one_wave ? GroupedAttentionKernel<T, kGroupUnroll, false>
                    : staged ? GroupedAttentionKernel<T, 1, true>
                             : GroupedAttentionKernel<T, 1, false>;
      Launch(kernel, grid, kGroupThreads, p, terms, q.data<T>(), cache.k.data<T>(),
             cache.v.data<T>(), out->data<T>(), m.data<float>(), l.data<float>(),
             acc.data<float>());
    });
  } else {
    const dim3 grid(static_cast<unsigned>(t), static_cast<unsigned>(hq),
                    static_cast<unsigned>(partitions));
    TGIS_DISPATCH_FLOAT(q.dtype(), op,
                        Launch(AttentionKernel<T>, grid, kThreads, p, terms, q.data<T>(),
                               cache.k.data<T>(), cache.v.data<T>(), out->data<T>(),
                               m.data<float>(), l.data<float>(), acc.data<float>()));
  }
  if (partitions > 1) {
    const dim3 cgrid(static_cast<unsigned>(t), static_cast<unsigned>(hq));
    TGIS_DISPATCH_FLOAT(
        q.dtype(), op,
        Launch(CombinePartitionsKernel<T>, cgrid, RowThreads(d), p, terms, m.data<float>(),
               l.data<float>(), acc.data<float>(), out->data<T>()));
  }
}

}  // namespace tgis::kernels::cuda

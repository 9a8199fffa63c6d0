// The paged KV cache on the CPU: writing new keys/values into it and attending over it.
// f32 accumulation, a two-pass softmax per query row, rows sharing a KV head computed together
// (AVX2 where Linear uses it, same switch; a scalar path otherwise). Prompts go in tasks of one
// sequence's rows for one KV head (f32 caches read in place, 16-bit ones converted a chunk at
// a time); decode steps in items of one sequence's positions for every KV head, read in place
// whatever the dtype, with the same bits (attention_avx2.cc).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/rotary_rows.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

void CheckCache(const KvCacheLayer& cache, const char* op) {
  TGIS_CHECK(cache.k.defined() && cache.v.defined(), "%s: cache tensors undefined", op);
  TGIS_CHECK(cache.k.rank() == 4 && cache.k.shape() == cache.v.shape(),
             "%s: cache k and v must both be [num_blocks, block_size, Hk, D]", op);
  TGIS_CHECK(cache.k.dtype() == cache.v.dtype() && IsFloatDType(cache.k.dtype()),
             "%s: cache must be f32, bf16 or f16", op);
}

// Stores n f32 values as the cache's dtype.
void StoreAs(DType t, void* base, int64_t at, const float* src, int64_t n) {
  switch (t) {
    case DType::kF32:
      std::copy(src, src + n, static_cast<float*>(base) + at);
      return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToF16(src[i]);
      return;
    }
    default:
      TGIS_FATAL("unsupported cache dtype %s", DTypeName(t));
  }
}

// A prompt sequence's keys and values as f32 [context, Hk, D], converted from a 16-bit cache
// once per call (PromptKvF32).
struct DenseKv {
  const float* k = nullptr;
  const float* v = nullptr;
};

// One task's key and value rows (KvSource): its sequence's positions through the block table,
// for its KV head, in the cache when it holds f32, in `dense` when given, else converted into
// per-thread buffers.
class CacheRows final : public KvSource {
 public:
  CacheRows(const KvCacheLayer& cache, const AttentionBatch& batch, int64_t s, int64_t kvh,
            int64_t max_blocks, int64_t context, DenseKv dense)
      : cache_(cache),
        batch_(batch),
        s_(s),
        kvh_(kvh),
        max_blocks_(max_blocks),
        context_(context),
        dense_(dense) {}
  const float* const* Keys(int64_t j0, int64_t j1) override {
    thread_local std::vector<float> buffer;
    thread_local std::vector<const float*> rows;
    return Fetch(cache_.k, dense_.k, j0, j1, &buffer, &rows);
  }
  const float* const* Values(int64_t j0, int64_t j1) override {
    thread_local std::vector<float> buffer;
    thread_local std::vector<const float*> rows;
    return Fetch(cache_.v, dense_.v, j0, j1, &buffer, &rows);
  }

 private:
  const float* const* Fetch(const Tensor& t, const float* dense, int64_t j0, int64_t j1,
                            std::vector<float>* buffer, std::vector<const float*>* rows) const {
    const int64_t n = j1 - j0 + 1, bs = t.dim(1), hk = t.dim(2), d = t.dim(3);
    rows->resize(n);
    if (dense != nullptr) {
      for (int64_t j = j0; j <= j1; ++j) (*rows)[j - j0] = dense + (j * hk + kvh_) * d;
      return rows->data();
    }
    const bool in_place = t.dtype() == DType::kF32;
    if (!in_place) buffer->resize(n * d);
    // The next chunk's rows are on their way while this one is used: rows of one KV head sit
    // Hk * D elements apart, a stride the hardware prefetchers do not follow far.
    const int64_t ahead_end = std::min(j1 + n, context_ - 1);
    const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(t.dtype());
    for (int64_t j = j1 + 1; j <= ahead_end; ++j) {
      const int64_t blk = IndexAt(batch_.block_tables, s_ * max_blocks_ + j / bs);
      const char* row = static_cast<const char*>(t.raw()) +
                        ((blk * bs + j % bs) * hk + kvh_) * d * DTypeSize(t.dtype());
      for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
    for (int64_t j = j0; j <= j1; ++j) {
      const int64_t blk = IndexAt(batch_.block_tables, s_ * max_blocks_ + j / bs);
      const int64_t at = ((blk * bs + j % bs) * hk + kvh_) * d;
      if (in_place) {
        (*rows)[j - j0] = t.data<float>() + at;
      } else {
        LoadF32(t, at, d, buffer->data() + (j - j0) * d);
        (*rows)[j - j0] = buffer->data() + (j - j0) * d;
      }
    }
    return rows->data();
  }

  const KvCacheLayer& cache_;
  const AttentionBatch& batch_;
  const int64_t s_, kvh_, max_blocks_, context_;
  const DenseKv dense_;
};

// The decode path's keys and values (PositionSource): whole positions, every KV head's row,
// read in place whatever the cache's dtype.
class PositionRows final : public PositionSource {
 public:
  PositionRows(const KvCacheLayer& cache, const AttentionBatch& batch, int64_t max_blocks)
      : cache_(cache), batch_(batch), max_blocks_(max_blocks) {}
  DType dtype() const override { return cache_.k.dtype(); }
  const void* const* Keys(int64_t s, int64_t j0, int64_t j1) override {
    thread_local std::vector<const void*> rows;
    return Fetch(cache_.k, s, j0, j1, &rows);
  }
  const void* const* Values(int64_t s, int64_t j0, int64_t j1) override {
    thread_local std::vector<const void*> rows;
    return Fetch(cache_.v, s, j0, j1, &rows);
  }

 private:
  const void* const* Fetch(const Tensor& t, int64_t s, int64_t j0, int64_t j1,
                           std::vector<const void*>* rows) const {
    const int64_t n = j1 - j0 + 1, bs = t.dim(1);
    const int64_t bytes = t.dim(2) * t.dim(3) * DTypeSize(t.dtype());  // a position's
    const char* base = static_cast<const char*>(t.raw());
    rows->resize(n);
    // A block's positions are contiguous: one table lookup a block. The next chunk's
    // positions are on their way while this one is used.
    const int64_t ahead_end = std::min(j1 + n, IndexAt(batch_.context_lens, s) - 1);
    for (int64_t j = j0; j <= ahead_end;) {
      const int64_t run_end = std::min(ahead_end, j / bs * bs + bs - 1);
      const char* p =
          base + (IndexAt(batch_.block_tables, s * max_blocks_ + j / bs) * bs + j % bs) * bytes;
      for (int64_t i = j; i <= run_end; ++i) {
        if (i <= j1) {
          (*rows)[i - j0] = p + (i - j) * bytes;
        } else {
          for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + (i - j) * bytes + b);
        }
      }
      j = run_end + 1;
    }
    return rows->data();
  }

  const KvCacheLayer& cache_;
  const AttentionBatch& batch_;
  const int64_t max_blocks_;
};

// The decode path's buffers at most (scores and partition sums, f32, kept by the calling
// thread): 64 MB, 128 sequences at 2048 keys with 32 heads of 128. Past it the per-task path
// runs, with the same bits.
constexpr int64_t kDecodeMaxFloats = int64_t{16} << 20;

// With a 16-bit cache, each prompt task (kTaskRows rows: 4 query positions at GQA 8) converted
// its own key and value rows, all keys up to its last row's: a 2048-token prompt's key rows were
// converted about 256 times each (a third more time than over an f32 cache: attention_bench
// --prefill 2048 --dtype bf16). Converted once per call instead, every prompt sequence's keys and
// values as f32 [context, Hk, D], over the threads, block by block (a block's positions are
// contiguous in the cache); exact, so the same bits. At most this many floats for keys and values
// together (256 MB, kept by the calling thread): past it the per-task conversion runs.
constexpr int64_t kPromptDenseMaxFloats = int64_t{64} << 20;

// Fills `dense` (one entry per sequence; none where it has no query rows) from `cache`, or
// leaves it empty (the tasks convert their own rows) when the f32 copies would pass
// kPromptDenseMaxFloats.
void PromptKvF32(const KvCacheLayer& cache, const AttentionBatch& batch, int64_t num_seqs,
                 int64_t max_blocks, std::vector<DenseKv>* dense) {
  const int64_t bs = cache.k.dim(1), row = cache.k.dim(2) * cache.k.dim(3);  // a position's
  std::vector<int64_t> at(num_seqs, -1);
  int64_t floats = 0;
  struct Block {
    int64_t s, b;
  };
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (IndexAt(batch.query_start, s + 1) == IndexAt(batch.query_start, s)) continue;
    const int64_t ctx = IndexAt(batch.context_lens, s);
    at[s] = floats;
    floats += ctx * row;
    for (int64_t b = 0; b * bs < ctx; ++b) blocks.push_back({s, b});
  }
  if (2 * floats > kPromptDenseMaxFloats) return;
  thread_local std::vector<float> keys, values;
  keys.resize(floats);
  values.resize(floats);
  float* const k = keys.data();  // workers write the calling thread's copies
  float* const v = values.data();
  ThreadPool::Global().Run(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    const auto [s, b] = blocks[i];
    const int64_t n = std::min(bs, IndexAt(batch.context_lens, s) - b * bs);
    const int64_t src = IndexAt(batch.block_tables, s * max_blocks + b) * bs * row;
    const int64_t dst = at[s] + b * bs * row;
    LoadF32(cache.k, src, n * row, k + dst);
    LoadF32(cache.v, src, n * row, v + dst);
  });
  dense->assign(num_seqs, DenseKv{});
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (at[s] >= 0) (*dense)[s] = {k + at[s], v + at[s]};
  }
}

// ---- the scalar path (no AVX2, or a head_dim that is not a multiple of 8) ------------------

// One query row against keys [lo, hi]: a two-pass softmax, key rows by position - first.
template <typename Logit>
void AttendRowScalar(const float* qrow, const float* const* key_rows,
                     const float* const* value_rows, int64_t first, int64_t lo, int64_t hi,
                     int64_t d, const Logit& logit, float sink, float* scores, float* orow) {
  // The attention sink (-inf: none) takes its share of the sum, never of the output.
  float mx = sink;
  for (int64_t j = lo; j <= hi; ++j) {
    const float* kr = key_rows[j - first];
    float dot = 0.f;
    for (int64_t c = 0; c < d; ++c) dot += qrow[c] * kr[c];
    const float sc = logit(j, dot);
    scores[j - first] = sc;
    mx = std::max(mx, sc);
  }
  float sum = std::isinf(sink) && sink < 0 ? 0.f : std::exp(sink - mx);
  std::fill(orow, orow + d, 0.f);
  for (int64_t j = lo; j <= hi; ++j) {
    const float p = std::exp(scores[j - first] - mx);
    sum += p;
    const float* vr = value_rows[j - first];
    for (int64_t c = 0; c < d; ++c) orow[c] += p * vr[c];
  }
  const float inv = 1.f / sum;
  for (int64_t c = 0; c < d; ++c) orow[c] *= inv;
}

}  // namespace

void ReshapeAndCache(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                     KvCacheLayer* cache) {
  const char* op = "ReshapeAndCache";
  CheckF32(k, op, "k");
  CheckF32(v, op, "v");
  CheckIndexTensor(slot_mapping, op, "slot_mapping");
  CheckCache(*cache, op);
  TGIS_CHECK(k.rank() == 3 && k.shape() == v.shape(), "%s: k and v must be [T, Hk, D]", op);
  const int64_t t_count = k.dim(0);
  const int64_t hk = k.dim(1);
  const int64_t d = k.dim(2);
  TGIS_CHECK(cache->k.dim(2) == hk && cache->k.dim(3) == d,
             "%s: cache heads/head_dim differ from k's", op);
  TGIS_CHECK(slot_mapping.numel() == t_count, "%s: slot_mapping has %lld entries, want %lld", op,
             static_cast<long long>(slot_mapping.numel()), static_cast<long long>(t_count));
  const int64_t num_slots = cache->k.dim(0) * cache->k.dim(1);
  const int64_t row = hk * d;
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t slot = IndexAt(slot_mapping, t);
    if (slot < 0) continue;
    TGIS_CHECK(slot < num_slots, "%s: slot %lld out of %lld", op, static_cast<long long>(slot),
               static_cast<long long>(num_slots));
    StoreAs(cache->k.dtype(), cache->k.raw(), slot * row, k.data<float>() + t * row, row);
    StoreAs(cache->v.dtype(), cache->v.raw(), slot * row, v.data<float>() + t * row, row);
  }
}

void QkvToCache(const Tensor& qkv, const RotaryConfig* rotary, const Tensor& positions,
                const Tensor& slot_mapping, Tensor* q, KvCacheLayer* cache) {
  const char* op = "QkvToCache";
  CheckF32(qkv, op, "qkv");
  CheckF32(*q, op, "q");
  CheckIndexTensor(slot_mapping, op, "slot_mapping");
  CheckCache(*cache, op);
  TGIS_CHECK(q->rank() == 3 && qkv.rank() == 2 && qkv.dim(0) == q->dim(0),
             "%s: q must be [T, Hq, D] and qkv [T, (Hq + 2 Hk) * D]", op);
  const int64_t t_count = q->dim(0), hq = q->dim(1), d = q->dim(2);
  const int64_t hk = cache->k.dim(2);
  TGIS_CHECK(cache->k.dim(3) == d && qkv.dim(1) == (hq + 2 * hk) * d,
             "%s: qkv has %lld columns, want (%lld + 2 x %lld cache heads) x %lld", op,
             static_cast<long long>(qkv.dim(1)), static_cast<long long>(hq),
             static_cast<long long>(hk), static_cast<long long>(d));
  TGIS_CHECK(slot_mapping.numel() == t_count, "%s: slot_mapping has %lld entries, want %lld", op,
             static_cast<long long>(slot_mapping.numel()), static_cast<long long>(t_count));
  if (rotary != nullptr) {
    CheckIndexTensor(positions, op, "positions");
    CheckRotary(*rotary, d, op);
    TGIS_CHECK(positions.numel() == t_count, "%s: positions has %lld entries, want %lld", op,
               static_cast<long long>(positions.numel()), static_cast<long long>(t_count));
  }
  const int64_t num_slots = cache->k.dim(0) * cache->k.dim(1);
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t slot = IndexAt(slot_mapping, t);
    TGIS_CHECK(slot < num_slots, "%s: slot %lld out of %lld", op, static_cast<long long>(slot),
               static_cast<long long>(num_slots));
  }
  const int64_t width = qkv.dim(1), q_width = hq * d, kv_width = hk * d;
  const int half = rotary != nullptr ? rotary->rotary_dim / 2 : 0;
  const float* src = qkv.data<float>();
  float* qp = q->data<float>();
  ParallelFor(t_count, 16, [&](int64_t b, int64_t e) {
    std::vector<float> angles(2 * half), k_row(kv_width);
    float* c = angles.data();
    float* s = c + half;
    for (int64_t t = b; t < e; ++t) {
      const float* row = src + t * width;
      float* q_row = qp + t * q_width;
      std::copy(row, row + q_width, q_row);
      const int64_t slot = IndexAt(slot_mapping, t);
      if (slot >= 0) std::copy(row + q_width, row + q_width + kv_width, k_row.data());
      if (rotary != nullptr) {
        RotaryAngles(*rotary, IndexAt(positions, t), c, s);
        for (int64_t h = 0; h < hq; ++h) RotateHead(*rotary, q_row + h * d, c, s);
        if (slot >= 0) {
          for (int64_t h = 0; h < hk; ++h) RotateHead(*rotary, k_row.data() + h * d, c, s);
        }
      }
      if (slot < 0) continue;
      StoreAs(cache->k.dtype(), cache->k.raw(), slot * kv_width, k_row.data(), kv_width);
      StoreAs(cache->v.dtype(), cache->v.raw(), slot * kv_width, row + q_width + kv_width,
              kv_width);
    }
  });
}

void PagedAttention(const Tensor& q, const KvCacheLayer& cache, const AttentionBatch& batch,
                    float scale, int sliding_window, const AttentionBias* bias, Tensor* out) {
  const char* op = "PagedAttention";
  CheckF32(q, op, "q");
  CheckCache(cache, op);
  CheckIndexTensor(batch.query_start, op, "query_start");
  CheckIndexTensor(batch.context_lens, op, "context_lens");
  CheckIndexTensor(batch.block_tables, op, "block_tables");
  TGIS_CHECK(q.rank() == 3, "%s: q must be [T, Hq, D]", op);
  const int64_t t_count = q.dim(0);
  const int64_t hq = q.dim(1);
  const int64_t d = q.dim(2);
  const int64_t num_blocks = cache.k.dim(0);
  const int64_t bs = cache.k.dim(1);
  const int64_t hk = cache.k.dim(2);
  TGIS_CHECK(cache.k.dim(3) == d, "%s: cache head_dim %lld, q head_dim %lld", op,
             static_cast<long long>(cache.k.dim(3)), static_cast<long long>(d));
  TGIS_CHECK(batch.block_size == bs, "%s: batch.block_size %d, cache block size %lld", op,
             batch.block_size, static_cast<long long>(bs));
  TGIS_CHECK(hk > 0 && hq % hk == 0, "%s: Hq %lld is not a multiple of Hk %lld", op,
             static_cast<long long>(hq), static_cast<long long>(hk));
  const int64_t num_seqs = batch.context_lens.numel();
  TGIS_CHECK(batch.query_start.numel() == num_seqs + 1, "%s: query_start must have S + 1 entries",
             op);
  TGIS_CHECK(IndexAt(batch.query_start, 0) == 0 && IndexAt(batch.query_start, num_seqs) == t_count,
             "%s: query_start must run from 0 to T", op);
  TGIS_CHECK(batch.block_tables.rank() == 2 && batch.block_tables.dim(0) == num_seqs,
             "%s: block_tables must be [S, max_blocks]", op);
  const int64_t max_blocks = batch.block_tables.dim(1);
  const std::vector<float>* alibi_slopes =
      bias != nullptr && !bias->alibi_slopes.empty() ? &bias->alibi_slopes : nullptr;
  TGIS_CHECK(alibi_slopes == nullptr || static_cast<int64_t>(alibi_slopes->size()) == hq,
             "%s: %zu ALiBi slopes for %lld heads", op, alibi_slopes ? alibi_slopes->size() : 0,
             static_cast<long long>(hq));
  const float* relative = nullptr;
  int num_buckets = 0;
  if (bias != nullptr && bias->relative_table.defined()) {
    CheckF32(bias->relative_table, op, "relative_table");
    num_buckets = bias->num_buckets;
    TGIS_CHECK(bias->relative_table.rank() == 2 && bias->relative_table.dim(0) == hq &&
                   bias->relative_table.dim(1) == num_buckets && num_buckets >= 2 &&
                   bias->max_distance > 0,
               "%s: relative_table must be [Hq, num_buckets]", op);
    relative = bias->relative_table.data<float>();
  }
  TGIS_CHECK(
      bias == nullptr || bias->sinks.empty() || static_cast<int64_t>(bias->sinks.size()) == hq,
      "%s: %zu attention sinks for %lld heads", op, bias->sinks.size(), static_cast<long long>(hq));
  TGIS_CHECK(batch.causal || sliding_window <= 0, "%s: a sliding window needs causal attention",
             op);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q0 = IndexAt(batch.query_start, s);
    const int64_t q1 = IndexAt(batch.query_start, s + 1);
    const int64_t ctx = IndexAt(batch.context_lens, s);
    TGIS_CHECK(q0 <= q1 && q1 - q0 <= ctx, "%s: sequence %lld has %lld queries, context %lld", op,
               static_cast<long long>(s), static_cast<long long>(q1 - q0),
               static_cast<long long>(ctx));
    TGIS_CHECK((ctx + bs - 1) / bs <= max_blocks, "%s: context %lld needs more than %lld blocks",
               op, static_cast<long long>(ctx), static_cast<long long>(max_blocks));
    for (int64_t b = 0; b < (ctx + bs - 1) / bs; ++b) {
      const int64_t blk = IndexAt(batch.block_tables, s * max_blocks + b);
      TGIS_CHECK(0 <= blk && blk < num_blocks, "%s: block %lld out of %lld", op,
                 static_cast<long long>(blk), static_cast<long long>(num_blocks));
    }
  }
  PrepareOut(out, q.shape(), op);

  const int64_t group = hq / hk;
  const float* qp = q.data<float>();
  float* out_p = out->data<float>();
  const bool vector = UseAvx2Kernels() && d % 8 == 0;
  const LogitBias logit_bias{alibi_slopes, relative, bias, bias != nullptr ? bias->softcap : 0};

  // The first key a query at qpos sees (its sliding window's start), on both paths.
  const auto first_key = [sliding_window](int64_t qpos) {
    return sliding_window > 0 ? std::max<int64_t>(0, qpos - sliding_window + 1) : int64_t{0};
  };

  // Decode steps (one query position a sequence) read whole positions instead.
  bool decode = vector;
  for (int64_t s = 0; s < num_seqs && decode; ++s)
    decode = IndexAt(batch.query_start, s + 1) - IndexAt(batch.query_start, s) <= 1;
  if (decode) {
    std::vector<DecodeSeq> seqs;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t q0 = IndexAt(batch.query_start, s);
      if (IndexAt(batch.query_start, s + 1) == q0) continue;
      const int64_t qpos = IndexAt(batch.context_lens, s) - 1;
      seqs.push_back({qp + q0 * hq * d, out_p + q0 * hq * d, qpos, first_key(qpos)});
    }
    PositionRows src(cache, batch, max_blocks);
    if (seqs.empty() ||
        AttendDecodeAvx2(seqs, &src, hq, hk, d, scale, logit_bias, kDecodeMaxFloats)) {
      return;
    }
  }

  // Tasks: rows [f0, f1) of sequence s's q_len x group rows for KV head kvh (row f: query
  // f / group, head kvh * group + f % group); at most kTaskRows rows, and at least two tasks
  // per thread when the rows allow (decode at batch 1).
  struct Task {
    int64_t s, kvh, f0, f1;
  };
  constexpr int64_t kTaskRows = 32;
  std::vector<Task> tasks;
  const int64_t want = 2 * ThreadPool::Global().size();
  const int64_t min_pieces = std::max<int64_t>(1, (want + num_seqs * hk - 1) / (num_seqs * hk));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows =
        (IndexAt(batch.query_start, s + 1) - IndexAt(batch.query_start, s)) * group;
    if (rows == 0) continue;
    const int64_t pieces = std::min(rows, std::max((rows + kTaskRows - 1) / kTaskRows, min_pieces));
    const int64_t per = (rows + pieces - 1) / pieces;
    for (int64_t kvh = 0; kvh < hk; ++kvh)
      for (int64_t f0 = 0; f0 < rows; f0 += per)
        tasks.push_back({s, kvh, f0, std::min(rows, f0 + per)});
  }

  std::vector<DenseKv> dense;
  if (vector && cache.k.dtype() != DType::kF32) {
    PromptKvF32(cache, batch, num_seqs, max_blocks, &dense);
  }
  ThreadPool::Global().Run(static_cast<int64_t>(tasks.size()), [&](int64_t task) {
    const Task& t = tasks[task];
    const int64_t q0 = IndexAt(batch.query_start, t.s);
    const int64_t q_len = IndexAt(batch.query_start, t.s + 1) - q0;
    const int64_t ctx = IndexAt(batch.context_lens, t.s);
    thread_local std::vector<AttnRow> rows;
    rows.clear();
    for (int64_t f = t.f0; f < t.f1; ++f) {
      const int64_t i = f / group, h = t.kvh * group + f % group;
      const int64_t qpos = ctx - q_len + i;
      const int64_t lo = first_key(qpos);
      const int64_t hi = batch.causal ? qpos : ctx - 1;
      rows.push_back(
          {qp + ((q0 + i) * hq + h) * d, out_p + ((q0 + i) * hq + h) * d, h, qpos, lo, hi});
    }
    // Rows come in query order, so the first has the lowest lo and the last the highest hi.
    const int64_t first = rows.front().lo, last = rows.back().hi;
    CacheRows kv(cache, batch, t.s, t.kvh, max_blocks, ctx, dense.empty() ? DenseKv{} : dense[t.s]);
    if (!vector) {
      thread_local std::vector<float> scores;
      scores.resize(last - first + 1);
      const float* const* key_rows = kv.Keys(first, last);
      const float* const* value_rows = kv.Values(first, last);
      for (const AttnRow& r : rows) {
        AttendRowScalar(
            r.q, key_rows, value_rows, first, r.lo, r.hi, d,
            [&](int64_t j, float dot) { return logit_bias.Add(r.h, r.qpos, j, dot * scale); },
            logit_bias.Sink(r.h), scores.data(), r.out);
      }
      return;
    }
    AttendRowsAvx2(rows, &kv, first, last, d, scale, logit_bias);
  });
}

}  // namespace tgis::kernels::cpu

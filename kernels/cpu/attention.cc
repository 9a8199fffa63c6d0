// The paged KV cache on the CPU: writing new keys/values into it and attending over it.
// f32 accumulation, a two-pass softmax per query row; q.k dot products and the p * v sums
// use AVX2 where Linear does (same switch), f32 caches are read in place.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/relative_position.h"

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

#define TGIS_ATTN_AVX2 __attribute__((target("avx2,fma")))

float DotScalar(const float* a, const float* b, int64_t n) {
  float dot = 0.f;
  for (int64_t c = 0; c < n; ++c) dot += a[c] * b[c];
  return dot;
}

// 8 lanes over c, a fixed horizontal sum, then the n % 8 tail.
TGIS_ATTN_AVX2 float DotAvx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float dot = _mm_cvtss_f32(h);
  for (; c < n; ++c) dot += a[c] * b[c];
  return dot;
}

// acc += p * v elementwise, rounded as the scalar loop rounds (a product, then a sum).
TGIS_ATTN_AVX2 void AddScaledAvx2(float* acc, float p, const float* v, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c),
                                            _mm256_mul_ps(pv, _mm256_loadu_ps(v + c))));
  }
  for (; c < n; ++c) acc[c] += p * v[c];
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
  float* op_out = out->data<float>();
  const bool avx2 = UseAvx2Kernels();
  const bool in_place = cache.k.dtype() == DType::kF32;  // else rows are converted to f32
  ThreadPool::Global().Run(num_seqs * hq, [&](int64_t task) {
    const int64_t s = task / hq;
    const int64_t h = task % hq;
    const int64_t q0 = IndexAt(batch.query_start, s);
    const int64_t q_len = IndexAt(batch.query_start, s + 1) - q0;
    const int64_t ctx = IndexAt(batch.context_lens, s);
    if (q_len == 0) return;
    const int64_t kvh = h / group;
    const float slope = alibi_slopes ? (*alibi_slopes)[h] : 0.f;
    // The keys any query row of this sequence may see: [first, ctx).
    const int64_t first_qpos = batch.causal ? ctx - q_len : 0;
    const int64_t first =
        sliding_window > 0 ? std::max<int64_t>(0, first_qpos - sliding_window + 1) : 0;
    // This head's key and value rows [first, ctx) in f32: in the cache itself when it is
    // f32, else converted into per-thread buffers.
    const int64_t n = ctx - first;
    thread_local std::vector<float> keys, values, scores, acc;
    thread_local std::vector<const float*> key_rows, value_rows;
    scores.resize(n);
    acc.resize(d);
    key_rows.resize(n);
    value_rows.resize(n);
    if (!in_place) {
      keys.resize(n * d);
      values.resize(n * d);
    }
    for (int64_t j = first; j < ctx; ++j) {
      const int64_t blk = IndexAt(batch.block_tables, s * max_blocks + j / bs);
      const int64_t at = ((blk * bs + j % bs) * hk + kvh) * d;
      if (in_place) {
        key_rows[j - first] = cache.k.data<float>() + at;
        value_rows[j - first] = cache.v.data<float>() + at;
      } else {
        LoadF32(cache.k, at, d, keys.data() + (j - first) * d);
        LoadF32(cache.v, at, d, values.data() + (j - first) * d);
        key_rows[j - first] = keys.data() + (j - first) * d;
        value_rows[j - first] = values.data() + (j - first) * d;
      }
    }
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t qpos = ctx - q_len + i;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, qpos - sliding_window + 1) : 0;
      const int64_t hi = batch.causal ? qpos : ctx - 1;  // the last key it sees
      const float* qrow = qp + ((q0 + i) * hq + h) * d;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= hi; ++j) {
        const float* kr = key_rows[j - first];
        const float dot = avx2 ? DotAvx2(qrow, kr, d) : DotScalar(qrow, kr, d);
        float sc = dot * scale;
        if (alibi_slopes) sc += slope * static_cast<float>(j - qpos);
        if (relative != nullptr) {
          sc += relative[h * num_buckets + RelativePositionBucket(static_cast<int>(j - qpos),
                                                                  bias->bidirectional, num_buckets,
                                                                  bias->max_distance)];
        }
        scores[j - first] = sc;
        mx = std::max(mx, sc);
      }
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = lo; j <= hi; ++j) {
        const float p = std::exp(scores[j - first] - mx);
        sum += p;
        const float* vr = value_rows[j - first];
        if (avx2) {
          AddScaledAvx2(acc.data(), p, vr, d);
        } else {
          for (int64_t c = 0; c < d; ++c) acc[c] += p * vr[c];
        }
      }
      float* orow = op_out + ((q0 + i) * hq + h) * d;
      const float inv = 1.f / sum;
      for (int64_t c = 0; c < d; ++c) orow[c] = acc[c] * inv;
    }
  });
}

}  // namespace tgis::kernels::cpu

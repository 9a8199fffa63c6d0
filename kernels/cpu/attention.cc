// The paged KV cache on the CPU: writing new keys/values into it and attending over it.
// f32 accumulation, a two-pass softmax per query row, rows sharing a KV head computed together
// (AVX2 where Linear uses it, same switch; a scalar path otherwise); f32 caches are read in
// place.
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

// What attention adds to a scaled score by the key's position relative to the query's.
struct LogitBias {
  const std::vector<float>* alibi_slopes;  // [Hq] or null
  const float* relative;                   // [Hq, num_buckets] or null
  const AttentionBias* bias;
  int num_buckets;

  bool any() const { return alibi_slopes != nullptr || relative != nullptr; }
  float Add(int64_t h, int64_t qpos, int64_t j, float sc) const {
    if (alibi_slopes) sc += (*alibi_slopes)[h] * static_cast<float>(j - qpos);
    if (relative != nullptr) {
      sc += relative[h * num_buckets + RelativePositionBucket(static_cast<int>(j - qpos),
                                                              bias->bidirectional, num_buckets,
                                                              bias->max_distance)];
    }
    return sc;
  }
};

// ---- the scalar path (no AVX2, or a head_dim that is not a multiple of 8) ------------------

// One query row against keys [lo, hi]: a two-pass softmax, key rows by position - first.
template <typename Logit>
void AttendRowScalar(const float* qrow, const float* const* key_rows,
                     const float* const* value_rows, int64_t first, int64_t lo, int64_t hi,
                     int64_t d, const Logit& logit, float* scores, float* orow) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j <= hi; ++j) {
    const float* kr = key_rows[j - first];
    float dot = 0.f;
    for (int64_t c = 0; c < d; ++c) dot += qrow[c] * kr[c];
    const float sc = logit(j, dot);
    scores[j - first] = sc;
    mx = std::max(mx, sc);
  }
  float sum = 0.f;
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

// ---- the AVX2 path --------------------------------------------------------------------------
//
// A task is a run of query rows of one sequence that share a KV head (GQA: the group's heads
// of each query position), so each key and value row is loaded once for all of them. Two
// passes: every score of the task's key range (2 rows x 4 keys per step, lanes over d), then
// per row its maximum, exp and sum, and the p * v sums (4 rows x 16 columns per step).
//
// What a row computes never depends on which rows share its task (so not on the batch, on
// chunked prefill or on the number of threads): a score is its own lanes-over-d sum with one
// fixed reduction tree; a row's exp and sum run over 8-lane tiles at absolute key positions,
// positions outside its own range holding exact zeros; its p * v sum adds key after key in
// order, and the zeros of other rows' positions leave it unchanged.

// e^x to about 1 ulp (Cephes' expf polynomial): lanes below -87.3 give 0 (their value is
// under FLT_MIN, beside a row maximum of 1); NaN stays NaN.
TGIS_ATTN_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
}

// Scaled scores of query rows q0, q1 against key rows k[0..3] into s0[0..3], s1[0..3].
TGIS_ATTN_AVX2 void Scores2x4(const float* q0, const float* q1, const float* const* k, int64_t d,
                              float scale, float* s0, float* s1) {
  __m256 a[8];
  for (__m256& v : a) v = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(q0 + c), x1 = _mm256_loadu_ps(q1 + c);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = _mm256_loadu_ps(k[i] + c);
      a[i] = _mm256_fmadd_ps(x0, kv, a[i]);
      a[4 + i] = _mm256_fmadd_ps(x1, kv, a[4 + i]);
    }
  }
  // Each sum: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 sum =
      _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  const __m256 scaled = _mm256_mul_ps(sum, _mm256_set1_ps(scale));
  _mm_storeu_ps(s0, _mm256_castps256_ps128(scaled));
  _mm_storeu_ps(s1, _mm256_extractf128_ps(scaled, 1));
}

// Row by row over 8-lane tiles at absolute positions from `base` (a multiple of 8) to hi_all:
// p = exp(score - mx) in [lo, hi], exactly 0 elsewhere, written over the scores; returns the
// sum of p (lane sums, then a fixed tree).
TGIS_ATTN_AVX2 float ExpRow(float* s, int64_t base, int64_t hi_all, int64_t lo, int64_t hi,
                            float mx) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo_m1 = _mm256_set1_epi32(static_cast<int32_t>(lo - 1));
  const __m256i hi_p1 = _mm256_set1_epi32(static_cast<int32_t>(hi + 1));
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j0 = base; j0 <= hi_all; j0 += 8) {
    const __m256i j = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j0)), iota);
    const __m256 in = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(j, lo_m1), _mm256_cmpgt_epi32(hi_p1, j)));
    float* at = s + (j0 - base);
    const __m256 p = _mm256_and_ps(in, Exp8(_mm256_sub_ps(_mm256_loadu_ps(at), m)));
    _mm256_storeu_ps(at, p);
    acc = _mm256_add_ps(acc, p);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// out[r][c, c + 8 * kVecs) = sum over keys j in [j0, j1] of p[r][j] * v_j[c, ...), key after
// key; p[r] is indexed by j - base, v_j is vrows[j - vfirst].
template <int kVecs>
TGIS_ATTN_AVX2 void Pv4(const float* const* p, int64_t base, const float* const* vrows,
                        int64_t vfirst, int64_t j0, int64_t j1, int64_t c, float* const* out) {
  __m256 a[4][kVecs];
  for (auto& row : a)
    for (__m256& v : row) v = _mm256_setzero_ps();
  for (int64_t j = j0; j <= j1; ++j) {
    const float* vr = vrows[j - vfirst] + c;
    __m256 v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = _mm256_loadu_ps(vr + 8 * i);
    for (int r = 0; r < 4; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p[r] + (j - base));
      for (int i = 0; i < kVecs; ++i) a[r][i] = _mm256_fmadd_ps(pr, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(out[r] + c + 8 * i, a[r][i]);
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
  float* out_p = out->data<float>();
  const bool in_place = cache.k.dtype() == DType::kF32;  // else rows are converted to f32
  const bool vector = UseAvx2Kernels() && d % 8 == 0;
  const LogitBias logit_bias{alibi_slopes, relative, bias, num_buckets};

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

  ThreadPool::Global().Run(static_cast<int64_t>(tasks.size()), [&](int64_t task) {
    const Task& t = tasks[task];
    const int64_t q0 = IndexAt(batch.query_start, t.s);
    const int64_t q_len = IndexAt(batch.query_start, t.s + 1) - q0;
    const int64_t ctx = IndexAt(batch.context_lens, t.s);
    struct Row {
      const float* q;
      float* out;
      int64_t h, qpos, lo, hi;  // the keys it sees: [lo, hi]
    };
    thread_local std::vector<Row> rows;
    rows.clear();
    for (int64_t f = t.f0; f < t.f1; ++f) {
      const int64_t i = f / group, h = t.kvh * group + f % group;
      const int64_t qpos = ctx - q_len + i;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, qpos - sliding_window + 1) : 0;
      const int64_t hi = batch.causal ? qpos : ctx - 1;
      rows.push_back(
          {qp + ((q0 + i) * hq + h) * d, out_p + ((q0 + i) * hq + h) * d, h, qpos, lo, hi});
    }
    // Rows come in query order, so the first has the lowest lo and the last the highest hi.
    const int64_t first = rows.front().lo, last = rows.back().hi;
    // This KV head's key and value rows [first, last] in f32: in the cache itself when it is
    // f32, else converted into per-thread buffers.
    const int64_t n = last - first + 1;
    thread_local std::vector<float> keys, values, scores;
    thread_local std::vector<const float*> key_rows, value_rows;
    key_rows.resize(n);
    value_rows.resize(n);
    if (!in_place) {
      keys.resize(n * d);
      values.resize(n * d);
    }
    for (int64_t j = first; j <= last; ++j) {
      const int64_t blk = IndexAt(batch.block_tables, t.s * max_blocks + j / bs);
      const int64_t at = ((blk * bs + j % bs) * hk + t.kvh) * d;
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
    if (!vector) {
      scores.resize(n);
      for (const Row& r : rows) {
        AttendRowScalar(
            r.q, key_rows.data(), value_rows.data(), first, r.lo, r.hi, d,
            [&](int64_t j, float dot) { return logit_bias.Add(r.h, r.qpos, j, dot * scale); },
            scores.data(), r.out);
      }
      return;
    }
    const int64_t count = static_cast<int64_t>(rows.size());
    const int64_t base = first / 8 * 8;
    const int64_t stride = (last + 1 - base + 4 + 7) / 8 * 8;  // a 4-key step may pass `last`
    scores.resize(count * stride);
    thread_local std::vector<float> zeros, sink, sums;
    if (static_cast<int64_t>(zeros.size()) < std::max(stride, d))
      zeros.assign(std::max(stride, d), 0.f);
    sink.resize(std::max<int64_t>(d, 4));
    sums.resize(count);
    // Pass 1: scaled scores of every row against every key of [first, last].
    for (int64_t j = first; j <= last; j += 4) {
      const float* k4[4];
      for (int64_t i = 0; i < 4; ++i)
        k4[i] = j + i <= last ? key_rows[j + i - first] : zeros.data();
      for (int64_t r = 0; r < count; r += 2) {
        const bool pair = r + 1 < count;
        Scores2x4(rows[r].q, pair ? rows[r + 1].q : zeros.data(), k4, d, scale,
                  scores.data() + r * stride + (j - base),
                  pair ? scores.data() + (r + 1) * stride + (j - base) : sink.data());
      }
    }
    // Per row: the position bias, the maximum over its own keys, then p and its sum.
    for (int64_t r = 0; r < count; ++r) {
      const Row& row = rows[r];
      float* sr = scores.data() + r * stride;  // position j at sr[j - base]
      if (logit_bias.any()) {
        for (int64_t j = row.lo; j <= row.hi; ++j)
          sr[j - base] = logit_bias.Add(row.h, row.qpos, j, sr[j - base]);
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = row.lo; j <= row.hi; ++j) mx = std::max(mx, sr[j - base]);
      sums[r] = ExpRow(sr, base, last, row.lo, row.hi, mx);
    }
    // Pass 2: p * v, four rows at a time over the keys any of them sees.
    for (int64_t r = 0; r < count; r += 4) {
      const float* p[4];
      float* o[4];
      for (int64_t i = 0; i < 4; ++i) {
        const bool real = r + i < count;
        p[i] = real ? scores.data() + (r + i) * stride : zeros.data();
        o[i] = real ? rows[r + i].out : sink.data();
      }
      const int64_t j0 = rows[r].lo, j1 = rows[std::min(count, r + 4) - 1].hi;
      for (int64_t c = 0; c < d; c += 16) {
        if (c + 16 <= d) {
          Pv4<2>(p, base, value_rows.data(), first, j0, j1, c, o);
        } else {
          Pv4<1>(p, base, value_rows.data(), first, j0, j1, c, o);
        }
      }
    }
    for (int64_t r = 0; r < count; ++r) {
      const float inv = 1.f / sums[r];
      for (int64_t c = 0; c < d; ++c) rows[r].out[c] *= inv;
    }
  });
}

}  // namespace tgis::kernels::cpu

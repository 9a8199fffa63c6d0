// The CPU attention's vector path (AVX2/FMA; attention.cc decides when it runs).
//
// A task is a run of query rows of one sequence that share a KV head (GQA: the group's heads
// of each query position), so each key and value row is loaded once for all of them. Two
// passes: every score of the task's key range (2 rows x 4 keys per step, lanes over d), then
// per row its maximum, exp and sum, and the p * v sums (4 rows x 16 columns per step). Both
// passes walk the keys kChunk at a time: the p * v sums go over a chunk's value rows once per
// 16 columns, and a chunk (16 KB at d = 128) stays in L1 for that, where the whole range
// (megabytes at long contexts) came back from memory each time.
//
// Decode steps (AttendDecodeAvx2) take the same steps split the other way: a work item is a
// sequence's 128-key partition with every KV head, so a thread reads whole positions (all KV
// heads' rows, contiguous in the cache) where a one-head task reads every Hk-th row, and a
// sequence at batch 1 still spreads over the threads. Measured on Zen 4, 2 threads
// (attention_bench --heads 32 --kv-heads 4 --head-dim 64 --cold 1, and engine_bench on the
// TinyLlama shape at a 1024-token prompt): see benchmarks/README.md, session 30.
//
// What a row computes never depends on which rows share its task or item (so not on the batch,
// on chunked prefill, on decode or prompt, or on the number of threads): a score is its own
// lanes-over-d sum with one fixed reduction tree; a row's exp and sum run over 8-lane tiles at
// absolute key positions, positions outside its own range holding exact zeros; its p * v sum
// goes partition by partition (kPartKeys), key after key within one, and the zeros of other
// rows' positions leave it unchanged.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/vector_math_avx2.h"

namespace tgis::kernels::cpu {

namespace {

#define TGIS_ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

// Element types of key and value rows: f32, or bf16 and f16 widened exactly in registers.
struct F32 {
  using Elem = float;
};
struct Bf16 {
  using Elem = uint16_t;
};
struct F16 {
  using Elem = uint16_t;
};

template <typename T>
TGIS_ATTN_AVX2 inline __m256 Load8(const typename T::Elem* p) {
  if constexpr (std::is_same_v<T, F32>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, Bf16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Scaled scores of R query rows q[r] against K = 8 / R key rows k[i] into s[r][i]: eight
// lanes-over-d sums at once, whatever R (many rows share a key where a GQA group allows, so a
// 16-bit key row is widened once for all of them).
template <int R, typename T>
TGIS_ATTN_AVX2 void Scores(const float* const* q, const typename T::Elem* const* k, int64_t d,
                           float scale, float* const* s) {
  constexpr int K = 8 / R;
  static_assert(R * K == 8, "eight sums a call");
  __m256 a[8];
  for (__m256& v : a) v = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 kv[K];
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) kv[i] = Load8<T>(k[i] + c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_loadu_ps(q[r] + c);
#pragma GCC unroll 8
      for (int i = 0; i < K; ++i) a[r * K + i] = _mm256_fmadd_ps(x, kv[i], a[r * K + i]);
    }
  }
  // Each sum: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); lane m holds sum m.
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 sum =
      _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < K; ++i) s[r][i] = out[r * K + i];
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

// The largest of s[0, n), NaNs skipped (-inf for none): 8 lanes, then the lanes and the tail
// in turn. A lane takes max(new, lane), which keeps the lane on a NaN as std::max(lane, new)
// does, so the result is the scalar loop's, up to the sign of a zero maximum (and exp(s - mx)
// does not see that sign).
TGIS_ATTN_AVX2 float RowMax(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + j), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// One row's scores s (position j at s[j - base], base a multiple of 8) of its keys [lo, hi]
// into p = exp(score + bias - max), tiles to hi_all as ExpRow; returns the sum of p. Both
// paths call it, so a row's p and sum cannot differ between them.
float RowSoftmax(float* s, int64_t base, int64_t hi_all, int64_t lo, int64_t hi, int64_t h,
                 int64_t qpos, const LogitBias& bias) {
  if (bias.softcap > 0) SoftCapAvx2(bias.softcap, s + (lo - base), hi - lo + 1);
  LogitBias positional = bias;
  positional.softcap = 0;
  if (positional.any()) {
    for (int64_t j = lo; j <= hi; ++j) s[j - base] = positional.Add(h, qpos, j, s[j - base]);
  }
  // A sink joins the maximum and the sum, never the p * v sums.
  const float sink = bias.Sink(h);
  const float mx = std::max(RowMax(s + (lo - base), hi - lo + 1), sink);
  const float sum = ExpRow(s, base, hi_all, lo, hi, mx);
  return std::isinf(sink) && sink < 0 ? sum : sum + std::exp(sink - mx);
}

// Keys a pass takes at a time: chunks at absolute positions [32 i, 32 i + 31].
constexpr int64_t kChunk = 32;
inline int64_t ChunkEnd(int64_t j) { return j / kChunk * kChunk + kChunk - 1; }

// The p * v sum of a row goes partition by partition, positions [128 i, 128 i + 127]: each
// partition's products key after key from zero, each partition's sum then added to the output
// in position order. Fixed by position, so the decode path can sum one sequence's partitions
// on several threads and give every row the bits of the per-task path.
constexpr int64_t kPartKeys = 128;
static_assert(kPartKeys % kChunk == 0, "chunks never straddle a partition");

// out[r][c, c + 8 * kVecs) += sum over keys j in [j0, j1] of p[r][j] * v_j[c, ...), key after
// key; p[r] is indexed by j - base, v_j is vrows[j - vfirst].
template <int kVecs, typename T>
TGIS_ATTN_AVX2 void Pv4(const float* const* p, int64_t base, const typename T::Elem* const* vrows,
                        int64_t vfirst, int64_t j0, int64_t j1, int64_t c, float* const* out) {
  // Unrolled so that the accumulators stay in registers (GCC kept them on the stack,
  // a store and a reload in every FMA chain: Pv4 was twice Scores2x4 for the same FMAs).
  __m256 a[4][kVecs];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < kVecs; ++i) a[r][i] = _mm256_loadu_ps(out[r] + c + 8 * i);
  const float* pr[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) pr[r] = p[r] - base;
  for (int64_t j = j0; j <= j1; ++j) {
    const typename T::Elem* vr = vrows[j - vfirst] + c;
    __m256 v[kVecs];
#pragma GCC unroll 2
    for (int i = 0; i < kVecs; ++i) v[i] = Load8<T>(vr + 8 * i);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m256 pj = _mm256_broadcast_ss(pr[r] + j);
#pragma GCC unroll 2
      for (int i = 0; i < kVecs; ++i) a[r][i] = _mm256_fmadd_ps(pj, v[i], a[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(out[r] + c + 8 * i, a[r][i]);
}

// Pv4 over every 16 columns (the last 8 if d is not a multiple of 16).
template <typename T>
TGIS_ATTN_AVX2 void PvSlabs(const float* const* p, int64_t base,
                            const typename T::Elem* const* vrows, int64_t vfirst, int64_t j0,
                            int64_t j1, int64_t d, float* const* out) {
  for (int64_t c = 0; c < d; c += 16) {
    if (c + 16 <= d) {
      Pv4<2, T>(p, base, vrows, vfirst, j0, j1, c, out);
    } else {
      Pv4<1, T>(p, base, vrows, vfirst, j0, j1, c, out);
    }
  }
}

// out += part, then part = 0.
void AddPart(float* part, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] += part[c];
  std::fill(part, part + d, 0.f);
}

void Normalize(float sum, int64_t d, float* out) {
  const float inv = 1.f / sum;
  for (int64_t c = 0; c < d; ++c) out[c] *= inv;
}

}  // namespace

void AttendRowsAvx2(const std::vector<AttnRow>& rows, KvSource* kv, int64_t first, int64_t last,
                    int64_t d, float scale, const LogitBias& bias) {
  thread_local std::vector<float> scores;
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
  for (int64_t jc = first; jc <= last;) {
    const int64_t jc_end = std::min(last, ChunkEnd(jc));
    const float* const* keys = kv->Keys(jc, jc_end);
    for (int64_t j = jc; j <= jc_end; j += 4) {
      const float* k4[4];
      for (int64_t i = 0; i < 4; ++i) k4[i] = j + i <= jc_end ? keys[j + i - jc] : zeros.data();
      for (int64_t r = 0; r < count; r += 2) {
        const bool pair = r + 1 < count;
        const float* q2[2] = {rows[r].q, pair ? rows[r + 1].q : zeros.data()};
        float* s2[2] = {scores.data() + r * stride + (j - base),
                        pair ? scores.data() + (r + 1) * stride + (j - base) : sink.data()};
        Scores<2, F32>(q2, k4, d, scale, s2);
      }
    }
    jc = jc_end + 1;
  }
  // Per row: the position bias, the maximum over its own keys, then p and its sum.
  for (int64_t r = 0; r < count; ++r) {
    const AttnRow& row = rows[r];
    sums[r] =
        RowSoftmax(scores.data() + r * stride, base, last, row.lo, row.hi, row.h, row.qpos, bias);
    std::fill(row.out, row.out + d, 0.f);
  }
  // Pass 2: p * v, a chunk of value rows at a time, four query rows at a time over the keys of
  // the chunk any of them sees: into each row's partition sum, added to its output at the
  // partition's end (see kPartKeys).
  thread_local std::vector<float> part;
  part.assign(count * d, 0.f);
  for (int64_t jc = first; jc <= last;) {
    const int64_t jc_end = std::min(last, ChunkEnd(jc));
    const float* const* values = nullptr;
    for (int64_t r = 0; r < count; r += 4) {
      const int64_t j0 = std::max(jc, rows[r].lo);
      const int64_t j1 = std::min(jc_end, rows[std::min(count, r + 4) - 1].hi);
      if (j0 > j1) continue;
      if (values == nullptr) values = kv->Values(jc, jc_end);
      const float* p[4];
      float* o[4];
      for (int64_t i = 0; i < 4; ++i) {
        const bool real = r + i < count;
        p[i] = real ? scores.data() + (r + i) * stride : zeros.data();
        o[i] = real ? part.data() + (r + i) * d : sink.data();
      }
      PvSlabs<F32>(p, base, values, jc, j0, j1, d, o);
    }
    if (jc_end == last || (jc_end + 1) % kPartKeys == 0) {
      for (int64_t r = 0; r < count; ++r) AddPart(part.data() + r * d, d, rows[r].out);
    }
    jc = jc_end + 1;
  }
  for (int64_t r = 0; r < count; ++r) Normalize(sums[r], d, rows[r].out);
}

namespace {

// The decode path's pass 1 for one item: the scores of every head's row of sequence s against
// keys [first, last] (first a multiple of 8), R rows of a KV head's group (R divides it) and
// 8 / R keys a step; row h's score of key j at scores[h * stride + j].
template <int R, typename T>
void ScoreKeys(const DecodeSeq& q, PositionSource* src, int64_t s, int64_t first, int64_t last,
               int64_t hk, int64_t group, int64_t d, float scale, float* scores, int64_t stride) {
  constexpr int K = 8 / R;
  using Elem = typename T::Elem;
  thread_local std::vector<Elem> zero_k;
  zero_k.assign(d, Elem{0});
  for (int64_t jc = first; jc <= last;) {
    const int64_t jc_end = std::min(last, ChunkEnd(jc));
    const void* const* keys = src->Keys(s, jc, jc_end);
    for (int64_t j = jc; j <= jc_end; j += K) {
      for (int64_t kvh = 0; kvh < hk; ++kvh) {
        const Elem* k[K];
        for (int i = 0; i < K; ++i) {
          k[i] = j + i <= jc_end ? static_cast<const Elem*>(keys[j + i - jc]) + kvh * d
                                 : zero_k.data();
        }
        for (int64_t g = 0; g < group; g += R) {
          const float* qs[R];
          float* out[R];
          for (int r = 0; r < R; ++r) {
            const int64_t h = kvh * group + g + r;
            qs[r] = q.q + h * d;
            out[r] = scores + h * stride + j;
          }
          Scores<R, T>(qs, k, d, scale, out);
        }
      }
    }
    jc = jc_end + 1;
  }
}

template <typename T>
bool AttendDecode(const std::vector<DecodeSeq>& seqs, PositionSource* src, int64_t hq, int64_t hk,
                  int64_t d, float scale, const LogitBias& bias, int64_t max_floats) {
  using Elem = typename T::Elem;
  const int64_t n = static_cast<int64_t>(seqs.size()), group = hq / hk;
  // Per sequence: scores [Hq][stride] at absolute positions (a step of keys may pass hi), and the
  // sums of its partitions from lo's to hi's, [partition][Hq][D].
  std::vector<int64_t> stride(n), score_at(n + 1, 0), part_at(n + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, partition)
  for (int64_t s = 0; s < n; ++s) {
    const DecodeSeq& q = seqs[s];
    stride[s] = (q.qpos + 1 + 8 + 7) / 8 * 8;
    score_at[s + 1] = score_at[s] + hq * stride[s];
    const int64_t m0 = q.lo / kPartKeys, m1 = q.qpos / kPartKeys;
    part_at[s + 1] = part_at[s] + (m1 - m0 + 1) * hq * d;
    for (int64_t m = m0; m <= m1; ++m) items.emplace_back(s, m);
  }
  if (score_at[n] + part_at[n] > max_floats) return false;
  // The calling thread's buffers, shared with the pool's threads by pointer (a thread_local
  // named inside a task would be the worker's own).
  thread_local std::vector<float> score_buffer, part_buffer, sum_buffer;
  score_buffer.resize(score_at[n]);
  part_buffer.resize(part_at[n]);
  sum_buffer.resize(n * hq);
  float* const scores = score_buffer.data();
  float* const parts = part_buffer.data();
  float* const sums = sum_buffer.data();
  // An item's keys: its partition's positions that its rows see, the scores from a multiple of
  // 8 below lo so that no step of keys writes into another item's positions.
  const auto span = [&](int64_t item, bool scores_pass) {
    const auto [s, m] = items[item];
    const int64_t lo = scores_pass ? seqs[s].lo / 8 * 8 : seqs[s].lo;
    return std::pair<int64_t, int64_t>{std::max(lo, m * kPartKeys),
                                       std::min(seqs[s].qpos, m * kPartKeys + kPartKeys - 1)};
  };
  ThreadPool& pool = ThreadPool::Global();
  // Pass 1: the scores of every head's row against the item's keys.
  // Rows a step: 8 measured no faster than 4 for groups of 8 (attention_bench, bf16, Zen 4).
  const int rows_a_step = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  pool.Run(static_cast<int64_t>(items.size()), [&](int64_t item) {
    const int64_t s = items[item].first;
    const auto [first, last] = span(item, true);
    float* row0 = scores + score_at[s];
    switch (rows_a_step) {
      case 4:
        return ScoreKeys<4, T>(seqs[s], src, s, first, last, hk, group, d, scale, row0, stride[s]);
      case 2:
        return ScoreKeys<2, T>(seqs[s], src, s, first, last, hk, group, d, scale, row0, stride[s]);
      default:
        return ScoreKeys<1, T>(seqs[s], src, s, first, last, hk, group, d, scale, row0, stride[s]);
    }
  });
  // Per row: the position bias, its maximum, then p and its sum.
  pool.Run(n * hq, [&](int64_t row) {
    const int64_t s = row / hq, h = row % hq;
    const DecodeSeq& q = seqs[s];
    const int64_t base = q.lo / 8 * 8;
    sums[row] = RowSoftmax(scores + score_at[s] + h * stride[s] + base, base, q.qpos, q.lo, q.qpos,
                           h, q.qpos, bias);
  });
  // Pass 2: each partition's p * v sums, four rows of a KV head at a time; the item that
  // finishes a sequence's last partition adds its rows' partitions in order (a barrier fewer).
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[n]);
  for (int64_t s = 0; s < n; ++s)
    left[s].store(seqs[s].qpos / kPartKeys - seqs[s].lo / kPartKeys + 1, std::memory_order_relaxed);
  pool.Run(static_cast<int64_t>(items.size()), [&](int64_t item) {
    const auto [s, m] = items[item];
    const auto [first, last] = span(item, false);
    const int64_t m0 = seqs[s].lo / kPartKeys;
    float* part = parts + part_at[s] + (m - m0) * hq * d;
    std::fill(part, part + hq * d, 0.f);
    thread_local std::vector<float> sink;
    sink.resize(d);
    thread_local std::vector<const Elem*> vrows;
    for (int64_t jc = first; jc <= last;) {
      const int64_t jc_end = std::min(last, ChunkEnd(jc));
      const void* const* values = src->Values(s, jc, jc_end);
      vrows.resize(jc_end - jc + 1);
      for (int64_t kvh = 0; kvh < hk; ++kvh) {
        for (int64_t j = jc; j <= jc_end; ++j)
          vrows[j - jc] = static_cast<const Elem*>(values[j - jc]) + kvh * d;
        for (int64_t g = 0; g < group; g += 4) {
          const float* p[4];
          float* o[4];
          for (int64_t i = 0; i < 4; ++i) {  // a missing row reads the first's p
            const int64_t h = kvh * group + g + (g + i < group ? i : 0);
            p[i] = scores + score_at[s] + h * stride[s];
            o[i] = g + i < group ? part + h * d : sink.data();
          }
          PvSlabs<T>(p, 0, vrows.data(), jc, jc, jc_end, d, o);
        }
      }
      jc = jc_end + 1;
    }
    // acq_rel: the last item sees every other item's partition sums.
    if (left[s].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int64_t h = 0; h < hq; ++h) {
      float* out = seqs[s].out + h * d;
      std::fill(out, out + d, 0.f);
      for (int64_t i = 0; i <= seqs[s].qpos / kPartKeys - m0; ++i)
        AddPart(parts + part_at[s] + (i * hq + h) * d, d, out);
      Normalize(sums[s * hq + h], d, out);
    }
  });
  return true;
}

}  // namespace

bool AttendDecodeAvx2(const std::vector<DecodeSeq>& seqs, PositionSource* src, int64_t hq,
                      int64_t hk, int64_t d, float scale, const LogitBias& bias,
                      int64_t max_floats) {
  switch (src->dtype()) {
    case DType::kF32:
      return AttendDecode<F32>(seqs, src, hq, hk, d, scale, bias, max_floats);
    case DType::kBF16:
      return AttendDecode<Bf16>(seqs, src, hq, hk, d, scale, bias, max_floats);
    case DType::kF16:
      return AttendDecode<F16>(seqs, src, hq, hk, d, scale, bias, max_floats);
    default:
      return false;
  }
}

}  // namespace tgis::kernels::cpu

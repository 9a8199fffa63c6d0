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
// What a row computes never depends on which rows share its task (so not on the batch, on
// chunked prefill or on the number of threads): a score is its own lanes-over-d sum with one
// fixed reduction tree; a row's exp and sum run over 8-lane tiles at absolute key positions,
// positions outside its own range holding exact zeros; its p * v sum adds key after key in
// order, and the zeros of other rows' positions leave it unchanged.
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "kernels/cpu/attention_rows.h"

namespace tgis::kernels::cpu {

namespace {

#define TGIS_ATTN_AVX2 __attribute__((target("avx2,fma")))

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

// Keys a pass takes at a time.
constexpr int64_t kChunk = 32;

// out[r][c, c + 8 * kVecs) += sum over keys j in [j0, j1] of p[r][j] * v_j[c, ...), key after
// key; p[r] is indexed by j - base, v_j is vrows[j - vfirst].
template <int kVecs>
TGIS_ATTN_AVX2 void Pv4(const float* const* p, int64_t base, const float* const* vrows,
                        int64_t vfirst, int64_t j0, int64_t j1, int64_t c, float* const* out) {
  __m256 a[4][kVecs];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < kVecs; ++i) a[r][i] = _mm256_loadu_ps(out[r] + c + 8 * i);
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
  for (int64_t jc = first; jc <= last; jc += kChunk) {
    const int64_t jc_end = std::min(last, jc + kChunk - 1);
    const float* const* keys = kv->Keys(jc, jc_end);
    for (int64_t j = jc; j <= jc_end; j += 4) {
      const float* k4[4];
      for (int64_t i = 0; i < 4; ++i) k4[i] = j + i <= jc_end ? keys[j + i - jc] : zeros.data();
      for (int64_t r = 0; r < count; r += 2) {
        const bool pair = r + 1 < count;
        Scores2x4(rows[r].q, pair ? rows[r + 1].q : zeros.data(), k4, d, scale,
                  scores.data() + r * stride + (j - base),
                  pair ? scores.data() + (r + 1) * stride + (j - base) : sink.data());
      }
    }
  }
  // Per row: the position bias, the maximum over its own keys, then p and its sum.
  for (int64_t r = 0; r < count; ++r) {
    const AttnRow& row = rows[r];
    float* sr = scores.data() + r * stride;  // position j at sr[j - base]
    if (bias.any()) {
      for (int64_t j = row.lo; j <= row.hi; ++j)
        sr[j - base] = bias.Add(row.h, row.qpos, j, sr[j - base]);
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = row.lo; j <= row.hi; ++j) mx = std::max(mx, sr[j - base]);
    sums[r] = ExpRow(sr, base, last, row.lo, row.hi, mx);
    std::fill(row.out, row.out + d, 0.f);
  }
  // Pass 2: p * v, a chunk of value rows at a time, four query rows at a time over the keys of
  // the chunk any of them sees (the sums still go key after key, in order).
  for (int64_t jc = first; jc <= last; jc += kChunk) {
    const int64_t jc_end = std::min(last, jc + kChunk - 1);
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
        o[i] = real ? rows[r + i].out : sink.data();
      }
      for (int64_t c = 0; c < d; c += 16) {
        if (c + 16 <= d) {
          Pv4<2>(p, base, values, jc, j0, j1, c, o);
        } else {
          Pv4<1>(p, base, values, jc, j0, j1, c, o);
        }
      }
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const float inv = 1.f / sums[r];
    for (int64_t c = 0; c < d; ++c) rows[r].out[c] *= inv;
  }
}

}  // namespace tgis::kernels::cpu

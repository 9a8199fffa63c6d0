// Internal to the CPU attention: the query rows of one task and the position bias, shared by
// attention.cc (tasks, the scalar path) and attention_avx2.cc (the vector path).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/ops.h"
#include "kernels/relative_position.h"

namespace tgis::kernels::cpu {

// One query row of a head: where its q and output are, and the keys it sees, [lo, hi].
struct AttnRow {
  const float* q;
  float* out;
  int64_t h, qpos, lo, hi;
};

// What attention does to a scaled score: a soft cap (Gemma 2's tanh, first, as transformers
// caps before the mask), then a bias by the key's position relative to the query's.
struct LogitBias {
  const std::vector<float>* alibi_slopes;  // [Hq] or null
  const float* relative;                   // bias's relative_table, [Hq, num_buckets], or null
  const AttentionBias* bias;
  float softcap = 0;  // > 0: AttentionBias::softcap

  bool any() const { return alibi_slopes != nullptr || relative != nullptr || softcap > 0; }
  float Add(int64_t h, int64_t qpos, int64_t j, float sc) const {
    if (softcap > 0) sc = std::tanh(sc / softcap) * softcap;
    if (alibi_slopes) sc += (*alibi_slopes)[h] * static_cast<float>(j - qpos);
    if (relative != nullptr) {
      sc += relative[h * bias->num_buckets +
                     RelativePositionBucket(static_cast<int>(j - qpos), bias->bidirectional,
                                            bias->num_buckets, bias->max_distance)];
    }
    return sc;
  }
  // Head h's attention sink (AttentionBias::sinks): one more logit in its softmax's
  // denominator; -inf (no share) for none.
  float Sink(int64_t h) const {
    return bias != nullptr && !bias->sinks.empty() ? bias->sinks[h]
                                                   : -std::numeric_limits<float>::infinity();
  }
};

// Where a task's key and value rows come from: f32 pointers to rows [j0, j1] of its KV head
// (position j at [j - j0]), into the cache when it holds f32, else converted into a buffer that
// the next call for the same kind reuses. Callers walk the keys a chunk at a time, so converted
// rows and re-read value rows stay in the core's caches.
class KvSource {
 public:
  virtual ~KvSource() = default;
  virtual const float* const* Keys(int64_t j0, int64_t j1) = 0;
  virtual const float* const* Values(int64_t j0, int64_t j1) = 0;
};

// The rows of one task (one sequence's rows for one KV head, in query order) against keys
// [first, last]; d a multiple of 8. Needs AVX2/FMA.
void AttendRowsAvx2(const std::vector<AttnRow>& rows, KvSource* kv, int64_t first, int64_t last,
                    int64_t d, float scale, const LogitBias& bias);

// Where the decode path's keys and values come from: for positions [j0, j1] of sequence s, a
// pointer per position (position j at [j - j0]) to its Hk * D values in the cache, every KV
// head's row, of dtype() (f32, bf16 or f16: the kernels widen 16-bit values in registers,
// exactly, as a converted copy would hold them). A position's rows are contiguous in the
// cache, so the decode path reads it in order.
class PositionSource {
 public:
  virtual ~PositionSource() = default;
  virtual DType dtype() const = 0;
  virtual const void* const* Keys(int64_t s, int64_t j0, int64_t j1) = 0;
  virtual const void* const* Values(int64_t s, int64_t j0, int64_t j1) = 0;
};

// A decode sequence: one query position (qpos), every head's q row ([Hq, D] at q) and output,
// and the keys its rows see, [lo, qpos].
struct DecodeSeq {
  const float* q;
  float* out;
  int64_t qpos, lo;
};

// Decode steps (one query row per head and sequence) with the bits of AttendRowsAvx2, the work
// split over positions instead of KV heads: each thread reads whole positions, every KV head's
// rows at once, in order, where a task of one KV head reads every Hk-th row. False (nothing
// done) when its buffers would pass `max_floats`; then the per-task path runs.
bool AttendDecodeAvx2(const std::vector<DecodeSeq>& seqs, PositionSource* src, int64_t hq,
                      int64_t hk, int64_t d, float scale, const LogitBias& bias,
                      int64_t max_floats);

}  // namespace tgis::kernels::cpu

// TopLogits (ops.h) on the CPU: a sampled row's log-sum-exp, probability mass and largest
// values, computed as the host sampler computes them (LogSumExp, which its log-softmax takes).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels {

float LogSumExp(std::span<const float> row) {
  float mx = -std::numeric_limits<float>::infinity();
  for (float f : row) mx = std::max(mx, f);
  double sum = 0;
  for (float f : row)
    sum +=
        f == -std::numeric_limits<float>::infinity() ? 0.0 : std::exp(static_cast<double>(f - mx));
  return mx + static_cast<float>(std::log(sum));
}

namespace cpu {

namespace {

// A float's bits as an unsigned key in the floats' order (NaN aside).
uint32_t OrderedKey(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

void TopOfRow(const float* logits, int64_t v, float temperature, int64_t count, float* values,
              int32_t* ids, float* stats) {
  std::vector<float> x(logits, logits + v);
  for (float& f : x) f /= temperature;
  const float lse = LogSumExp(x);
  if (std::isnan(lse)) {  // a NaN or +inf in the row
    std::fill(values, values + count, std::numeric_limits<float>::quiet_NaN());
    std::fill(ids, ids + count, -1);
    stats[0] = stats[1] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  double mass = 0;
  for (float f : x) mass += std::exp(f - lse);
  stats[0] = lse;
  stats[1] = static_cast<float>(mass);
  // Candidates: every value whose key's top 11 bits are at least those of the count-th largest;
  // then the largest `count` of them.
  std::array<int64_t, 2048> hist{};
  for (float f : x) ++hist[OrderedKey(f) >> 21];
  int64_t held = 0;
  uint32_t bin = 2048;
  while (held < count) held += hist[--bin];
  std::vector<int32_t> cand;
  cand.reserve(held);
  for (int64_t i = 0; i < v; ++i) {
    if ((OrderedKey(x[i]) >> 21) >= bin) cand.push_back(static_cast<int32_t>(i));
  }
  std::nth_element(cand.begin(), cand.begin() + (count - 1), cand.end(),
                   [&x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  for (int64_t i = 0; i < count; ++i) {
    ids[i] = cand[i];
    values[i] = x[cand[i]];
  }
}

}  // namespace

void TopLogits(const Tensor& logits, const Tensor& rows, const Tensor& temperatures, int64_t count,
               Tensor* values, Tensor* ids, Tensor* stats) {
  const char* op = "TopLogits";
  CheckF32(logits, op, "logits");
  CheckIndexTensor(rows, op, "rows");
  CheckF32(temperatures, op, "temperatures");
  TGIS_CHECK(logits.rank() == 2 && temperatures.numel() == rows.numel(),
             "%s: logits [R, V], rows [S] and temperatures [S]", op);
  const int64_t s = rows.numel(), v = logits.dim(1);
  TGIS_CHECK(count >= 1 && count <= v, "%s: count %lld outside [1, %lld]", op,
             static_cast<long long>(count), static_cast<long long>(v));
  PrepareOut(values, {s, count}, op);
  PrepareOut(stats, {s, 2}, op);
  if (!ids->defined()) *ids = Tensor::Empty({s, count}, DType::kI32);
  TGIS_CHECK(ids->dtype() == DType::kI32 && ids->shape() == Shape({s, count}),
             "%s: ids must be [S, count] i32", op);
  ParallelFor(s, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = IndexAt(rows, i);
      TGIS_CHECK(r >= 0 && r < logits.dim(0), "%s: row %lld outside the logits", op,
                 static_cast<long long>(r));
      TopOfRow(logits.data<float>() + r * v, v, temperatures.data<float>()[i], count,
               values->data<float>() + i * count, ids->data<int32_t>() + i * count,
               stats->data<float>() + i * 2);
    }
  });
}

}  // namespace cpu
}  // namespace tgis::kernels

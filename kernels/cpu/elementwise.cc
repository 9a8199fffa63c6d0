// Embedding, norms, activations and softmax on the CPU (f32 activations).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/vector_math_avx2.h"

namespace tgis::kernels::cpu {

namespace {

// Rows of a [..., H] tensor processed per parallel chunk: about 16K elements.
int64_t RowGrain(int64_t h) { return std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(1, h)); }

int64_t LastDim(const Tensor& t) { return t.dim(-1); }

}  // namespace

void Embedding(const Tensor& ids, const Tensor& weight, Tensor* out) {
  CheckIndexTensor(ids, "Embedding", "ids");
  TGIS_CHECK(weight.rank() == 2 && IsFloatDType(weight.dtype()),
             "Embedding: weight must be [V, H] f32/bf16/f16");
  const int64_t t_count = ids.numel();
  const int64_t vocab = weight.dim(0);
  const int64_t h = weight.dim(1);
  PrepareOut(out, {t_count, h}, "Embedding");
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t id = IndexAt(ids, t);
    TGIS_CHECK(0 <= id && id < vocab, "Embedding: id %lld out of [0, %lld)",
               static_cast<long long>(id), static_cast<long long>(vocab));
  }
  float* o = out->data<float>();
  ParallelFor(t_count, RowGrain(h), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) LoadF32(weight, IndexAt(ids, t) * h, h, o + t * h);
  });
}

void EmbeddingSlice(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out) {
  CheckIndexTensor(ids, "EmbeddingSlice", "ids");
  TGIS_CHECK(weight.rank() == 2 && IsFloatDType(weight.dtype()),
             "EmbeddingSlice: weight must be [V, H] f32/bf16/f16");
  const int64_t t_count = ids.numel(), vocab = weight.dim(0), h = weight.dim(1);
  PrepareOut(out, {t_count, h}, "EmbeddingSlice");
  float* o = out->data<float>();
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t row = IndexAt(ids, t) - first_id;
    if (0 <= row && row < vocab) {
      LoadF32(weight, row * h, h, o + t * h);
    } else {
      std::fill(o + t * h, o + (t + 1) * h, 0.0f);
    }
  }
}

void CopyColumns(const Tensor& src, int64_t src_col, int64_t ncols, Tensor* dst, int64_t dst_col) {
  TGIS_CHECK(src.rank() == 2 && dst->rank() == 2 && src.dim(0) == dst->dim(0) &&
                 src.dtype() == dst->dtype(),
             "CopyColumns: src and dst must be 2-d with the same rows and dtype");
  TGIS_CHECK(0 <= src_col && src_col + ncols <= src.dim(1) && 0 <= dst_col &&
                 dst_col + ncols <= dst->dim(1),
             "CopyColumns: columns out of range");
  const size_t es = DTypeSize(src.dtype());
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst->raw());
  for (int64_t r = 0; r < src.dim(0); ++r) {
    std::memcpy(d + (r * dst->dim(1) + dst_col) * es, s + (r * src.dim(1) + src_col) * es,
                ncols * es);
  }
}

void AddRmsNorm(Tensor* x, const Tensor& y, const Tensor& w, float eps, Tensor* out) {
  cpu::AddInPlace(x, y);
  cpu::RmsNorm(*x, w, eps, out);
}

void RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor* out) {
  CheckF32(x, "RmsNorm", "x");
  const int64_t h = LastDim(x);
  TGIS_CHECK(w.numel() == h, "RmsNorm: weight has %lld elements, want %lld",
             static_cast<long long>(w.numel()), static_cast<long long>(h));
  if (out != &x) PrepareOut(out, x.shape(), "RmsNorm");
  const std::vector<float> wf = ToFloatVector(w);
  const int64_t rows = x.numel() / std::max<int64_t>(1, h);
  const float* xp = x.data<float>();
  float* op = out->data<float>();
  ParallelFor(rows, RowGrain(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * h;
      float* orow = op + r * h;
      double ss = 0;
      for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / h + eps));
      for (int64_t i = 0; i < h; ++i) orow[i] = wf[i] * (xr[i] * inv);
    }
  });
}

void LayerNorm(const Tensor& x, const Tensor& w, const Tensor* bias, float eps, Tensor* out) {
  CheckF32(x, "LayerNorm", "x");
  const int64_t h = LastDim(x);
  TGIS_CHECK(w.numel() == h, "LayerNorm: weight size mismatch");
  const bool has_bias = bias != nullptr && bias->defined();
  TGIS_CHECK(!has_bias || bias->numel() == h, "LayerNorm: bias size mismatch");
  if (out != &x) PrepareOut(out, x.shape(), "LayerNorm");
  const std::vector<float> wf = ToFloatVector(w);
  const std::vector<float> bf = has_bias ? ToFloatVector(*bias) : std::vector<float>(h, 0.f);
  const int64_t rows = x.numel() / std::max<int64_t>(1, h);
  const float* xp = x.data<float>();
  float* op = out->data<float>();
  ParallelFor(rows, RowGrain(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * h;
      float* orow = op + r * h;
      double sum = 0;
      for (int64_t i = 0; i < h; ++i) sum += xr[i];
      const double mean = sum / h;
      double var = 0;
      for (int64_t i = 0; i < h; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      const double rstd = 1.0 / std::sqrt(var / h + eps);
      // Centre in f64: an f32 mean would cost up to |mean| * 2^-24 of every output.
      for (int64_t i = 0; i < h; ++i)
        orow[i] = static_cast<float>((xr[i] - mean) * rstd) * wf[i] + bf[i];
    }
  });
}

void AddInPlace(Tensor* x, const Tensor& y) {
  CheckF32(*x, "AddInPlace", "x");
  CheckF32(y, "AddInPlace", "y");
  TGIS_CHECK(x->shape() == y.shape(), "AddInPlace: shapes differ");
  float* xp = x->data<float>();
  const float* yp = y.data<float>();
  ParallelFor(x->numel(), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) xp[i] += yp[i];
  });
}

namespace {

float ActivateOne(Activation kind, float v) {
  switch (kind) {
    case Activation::kRelu:
      return v < 0 ? 0.0f : v;  // NaN stays NaN, as in torch.relu
    case Activation::kSilu:
      return v / (1.0f + std::exp(-v));
    case Activation::kGeluErf:
      return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752440f));
    case Activation::kGeluTanh:
      return 0.5f * v * (1.0f + std::tanh(0.79788456080286535588f * (v + 0.044715f * v * v * v)));
  }
  return v;
}

}  // namespace

void GatedActivation(Activation kind, const Tensor& gate_up, Tensor* out) {
  CheckF32(gate_up, "GatedActivation", "gate_up");
  const int64_t two_i = LastDim(gate_up);
  TGIS_CHECK(two_i % 2 == 0, "GatedActivation: last dim %lld is odd",
             static_cast<long long>(two_i));
  const int64_t inter = two_i / 2;
  const int64_t rows = gate_up.numel() / std::max<int64_t>(1, two_i);
  Shape shape = gate_up.shape();
  shape.back() = inter;
  PrepareOut(out, shape, "GatedActivation");
  const float* g = gate_up.data<float>();
  float* o = out->data<float>();
  const bool avx2 = UseAvx2Kernels();
  ParallelFor(rows, RowGrain(two_i), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* gr = g + r * two_i;
      const float* ur = gr + inter;
      float* orow = o + r * inter;
      if (avx2) {
        ActivateAvx2(kind, gr, ur, orow, inter);
      } else {
        for (int64_t i = 0; i < inter; ++i) orow[i] = ActivateOne(kind, gr[i]) * ur[i];
      }
    }
  });
}

void ClampedSwiGlu(const Tensor& gate_up, float alpha, float limit, Tensor* out) {
  const char* op = "ClampedSwiGlu";
  CheckF32(gate_up, op, "gate_up");
  const int64_t two_i = LastDim(gate_up);
  TGIS_CHECK(two_i % 2 == 0, "%s: last dim %lld is odd", op, static_cast<long long>(two_i));
  const int64_t inter = two_i / 2;
  const int64_t rows = gate_up.numel() / std::max<int64_t>(1, two_i);
  Shape shape = gate_up.shape();
  shape.back() = inter;
  PrepareOut(out, shape, op);
  const float* g = gate_up.data<float>();
  float* o = out->data<float>();
  const bool avx2 = UseAvx2Kernels();
  ParallelFor(rows, RowGrain(two_i), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* gr = g + r * two_i;
      const float* ur = gr + inter;
      float* orow = o + r * inter;
      if (avx2) {
        ClampedSwiGluAvx2(alpha, limit, gr, ur, orow, inter);
        continue;
      }
      for (int64_t i = 0; i < inter; ++i) {
        // std::min(x, limit) and std::clamp keep a NaN x, as torch.clamp does.
        const float gate = std::min(gr[i], limit);
        const float up = std::clamp(ur[i], -limit, limit);
        orow[i] = (up + 1.0f) * (gate / (1.0f + std::exp(-alpha * gate)));
      }
    }
  });
}

void Activate(Activation kind, Tensor* x) {
  CheckF32(*x, "Activate", "x");
  float* p = x->data<float>();
  const bool avx2 = UseAvx2Kernels();
  ParallelFor(x->numel(), 1 << 14, [&](int64_t b, int64_t e) {
    if (avx2) {
      ActivateAvx2(kind, p + b, nullptr, p + b, e - b);
    } else {
      for (int64_t i = b; i < e; ++i) p[i] = ActivateOne(kind, p[i]);
    }
  });
}

void Clamp(float lo, float hi, Tensor* x) {
  CheckF32(*x, "Clamp", "x");
  float* p = x->data<float>();
  ParallelFor(x->numel(), 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = std::min(std::max(p[i], lo), hi);
  });
}

void Scale(float factor, Tensor* x) {
  CheckF32(*x, "Scale", "x");
  float* p = x->data<float>();
  ParallelFor(x->numel(), 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] *= factor;
  });
}

void SoftCap(float cap, Tensor* x) {
  CheckF32(*x, "SoftCap", "x");
  float* p = x->data<float>();
  const bool avx2 = UseAvx2Kernels();
  ParallelFor(x->numel(), 1 << 12, [&](int64_t b, int64_t e) {
    if (avx2) {
      SoftCapAvx2(cap, p + b, e - b);
    } else {
      for (int64_t i = b; i < e; ++i) p[i] = std::tanh(p[i] / cap) * cap;
    }
  });
}

void AddWeightedRows(const Tensor& src, const Tensor& rows, const Tensor& weights, Tensor* out) {
  const char* op = "AddWeightedRows";
  CheckF32(src, op, "src");
  CheckF32(*out, op, "out");
  CheckF32(weights, op, "weights");
  CheckIndexTensor(rows, op, "rows");
  TGIS_CHECK(src.rank() == 2 && out->rank() == 2 && src.dim(1) == out->dim(1),
             "%s: src [N, H] and out [T, H] must share H", op);
  const int64_t n = src.dim(0), h = src.dim(1), t = out->dim(0);
  TGIS_CHECK(rows.numel() == n && weights.numel() == n, "%s: want one row index and weight per row",
             op);
  std::vector<bool> taken(t, false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = IndexAt(rows, i);
    TGIS_CHECK(0 <= r && r < t && !taken[r], "%s: row %lld is out of [0, %lld) or repeated", op,
               static_cast<long long>(r), static_cast<long long>(t));
    taken[r] = true;
  }
  const float* s = src.data<float>();
  const float* w = weights.data<float>();
  float* o = out->data<float>();
  ParallelFor(n, RowGrain(h), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* dst = o + IndexAt(rows, i) * h;
      for (int64_t j = 0; j < h; ++j) dst[j] += s[i * h + j] * w[i];
    }
  });
}

namespace {

template <bool kLog>
void SoftmaxImpl(Tensor* x, const char* op) {
  CheckF32(*x, op, "x");
  const int64_t n = LastDim(*x);
  const int64_t rows = x->numel() / std::max<int64_t>(1, n);
  float* p = x->data<float>();
  ParallelFor(rows, RowGrain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = p + r * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
      // exp in f32 (as torch), the sum in f64 so that long rows (vocabularies) lose nothing.
      double sum = 0;
      if (kLog) {
        for (int64_t i = 0; i < n; ++i) sum += std::exp(row[i] - mx);
        const float log_sum = static_cast<float>(std::log(sum));
        for (int64_t i = 0; i < n; ++i) row[i] = (row[i] - mx) - log_sum;
      } else {
        for (int64_t i = 0; i < n; ++i) {
          row[i] = std::exp(row[i] - mx);
          sum += row[i];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t i = 0; i < n; ++i) row[i] *= inv;
      }
    }
  });
}

}  // namespace

void Softmax(Tensor* x) { SoftmaxImpl<false>(x, "Softmax"); }
void LogSoftmax(Tensor* x) { SoftmaxImpl<true>(x, "LogSoftmax"); }

void RepetitionPenalty(Tensor* logits, const Tensor& tokens, const Tensor& penalties) {
  const char* op = "RepetitionPenalty";
  CheckF32(*logits, op, "logits");
  CheckIndexTensor(tokens, op, "tokens");
  CheckF32(penalties, op, "penalties");
  TGIS_CHECK(logits->rank() == 2 && tokens.rank() == 2 && tokens.dim(0) == logits->dim(0) &&
                 penalties.numel() == logits->dim(0),
             "%s: logits [R, V], tokens [R, M] and penalties [R]", op);
  const int64_t rows = logits->dim(0), v = logits->dim(1), m = tokens.dim(1);
  for (int64_t r = 0; r < rows; ++r) {
    const float p = penalties.data<float>()[r];
    if (p == 1.0f) continue;
    float* x = logits->data<float>() + r * v;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t t = IndexAt(tokens, r * m + j);
      if (t < 0 || t >= v) continue;
      x[t] = x[t] < 0 ? x[t] * p : x[t] / p;
    }
  }
}

void GreedyPick(Tensor* logits, const Tensor& banned, Tensor* ids, Tensor* logprobs) {
  CheckF32(*logits, "GreedyPick", "logits");
  TGIS_CHECK(logits->rank() == 2, "GreedyPick: logits must be [R, V]");
  const int64_t rows = logits->dim(0), v = logits->dim(1);
  const bool has_banned = banned.defined() && banned.numel() > 0;
  if (has_banned) {
    CheckIndexTensor(banned, "GreedyPick", "banned");
    TGIS_CHECK(banned.rank() == 2 && banned.dim(0) == rows, "GreedyPick: banned must be [R, M]");
  }
  if (!ids->defined()) *ids = Tensor::Empty({rows}, DType::kI32);
  if (!logprobs->defined()) *logprobs = Tensor::Empty({rows}, DType::kF32);
  TGIS_CHECK(ids->dtype() == DType::kI32 && ids->numel() == rows && logprobs->numel() == rows &&
                 logprobs->dtype() == DType::kF32,
             "GreedyPick: ids [R] i32 and logprobs [R] f32");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = logits->data<float>() + r * v;
    if (has_banned) {
      for (int64_t m = 0; m < banned.dim(1); ++m) {
        const int64_t t = IndexAt(banned, r * banned.dim(1) + m);
        if (0 <= t && t < v) x[t] = -std::numeric_limits<float>::infinity();
      }
    }
    if (std::any_of(x, x + v, [](float f) { return std::isnan(f) || f == kInf; })) {
      ids->data<int32_t>()[r] = -1;
      logprobs->data<float>()[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int64_t best = std::max_element(x, x + v) - x;
    double sum = 0;
    for (int64_t i = 0; i < v; ++i) sum += std::exp(static_cast<double>(x[i]) - x[best]);
    ids->data<int32_t>()[r] = static_cast<int32_t>(best);
    logprobs->data<float>()[r] = static_cast<float>(-std::log(sum));
  }
}

}  // namespace tgis::kernels::cpu

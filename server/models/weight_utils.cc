#include "server/models/weight_utils.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<Tensor> LoadF32(const WeightStore& w, const std::string& name, bool transpose) {
  auto t = w.Get(name, DType::kF32);
  if (!t.ok()) return t.status();
  if (!transpose) return *t;
  if (t->rank() != 2) return absl::InvalidArgumentError(absl::StrCat(name, ": expected 2-D"));
  const int64_t r = t->dim(0), c = t->dim(1);
  Tensor out = Tensor::Empty({c, r}, DType::kF32);
  const float* src = t->data<float>();
  float* dst = out.data<float>();
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < c; ++j) dst[j * r + i] = src[i * c + j];
  }
  return out;
}

Tensor ConcatRows(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.dim(0);
  kernels::Shape shape = parts[0].shape();
  shape[0] = rows;
  Tensor out = Tensor::Empty(shape, DType::kF32);
  size_t off = 0;
  for (const Tensor& p : parts) {
    std::memcpy(static_cast<char*>(out.raw()) + off, p.raw(), p.nbytes());
    off += p.nbytes();
  }
  return out;
}

Tensor DeinterleaveQkv(const Tensor& t, int64_t heads, int64_t d) {
  const int64_t cols = t.rank() == 2 ? t.dim(1) : 1;
  Tensor out = Tensor::Empty(t.shape(), DType::kF32);
  const float* src = t.data<float>();
  float* dst = out.data<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t part = 0; part < 3; ++part) {
      const float* from = src + (h * 3 + part) * d * cols;
      float* to = dst + (part * heads + h) * d * cols;
      std::memcpy(to, from, d * cols * sizeof(float));
    }
  }
  return out;
}

Tensor ToRunDType(const Tensor& t, DType dtype) {
  return t.dtype() == dtype ? t : t.To(dtype);
}

absl::StatusOr<kernels::GeluKind> GeluFromName(const std::string& act) {
  if (act == "gelu") return kernels::GeluKind::kErf;
  if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast") {
    return kernels::GeluKind::kTanh;
  }
  return absl::UnimplementedError(absl::StrCat("config.json: activation '", act, "' is not supported"));
}

}  // namespace tgis::server

#include "kernels/cpu/common.h"

#include <immintrin.h>

#include <cstring>
#include <string>

#include "kernels/cpu/linear_stream.h"  // CpuHasAvx2: AVX2, FMA and F16C

namespace tgis::kernels::cpu {

namespace {

std::string ShapeStr(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

void PrepareOut(Tensor* out, const Shape& shape, const char* op) {
  TGIS_CHECK(out != nullptr, "%s: out is null", op);
  if (!out->defined()) {
    *out = Tensor::Empty(shape, DType::kF32, Device::kCpu);
    return;
  }
  TGIS_CHECK(out->shape() == shape, "%s: out has shape %s, want %s", op,
             ShapeStr(out->shape()).c_str(), ShapeStr(shape).c_str());
  TGIS_CHECK(out->dtype() == DType::kF32 && out->device() == Device::kCpu,
             "%s: out must be an f32 CPU tensor, not %s", op, DTypeName(out->dtype()));
}

void CheckF32(const Tensor& t, const char* op, const char* what) {
  TGIS_CHECK(t.defined(), "%s: %s is undefined", op, what);
  TGIS_CHECK(t.dtype() == DType::kF32 && t.device() == Device::kCpu,
             "%s: %s must be an f32 CPU tensor (activations are f32 on the CPU), not %s", op, what,
             DTypeName(t.dtype()));
}

void CheckIndexTensor(const Tensor& t, const char* op, const char* what) {
  TGIS_CHECK(t.defined(), "%s: %s is undefined", op, what);
  TGIS_CHECK(t.dtype() == DType::kI32 || t.dtype() == DType::kI64,
             "%s: %s must be i32 or i64, not %s", op, what, DTypeName(t.dtype()));
}

namespace {
// The whole groups of eight, widened with AVX2; returns how many values that was.
TGIS_AVX2 int64_t Bf16ToF32Avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Widen8Bf16(s + i));
  return i;
}
TGIS_AVX2 int64_t F16ToF32Avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Widen8F16(s + i));
  return i;
}
}  // namespace

// Both conversions are exact, so the scalar loops give the same floats: the attention's
// per-chunk key and value rows of 16-bit caches, and checkpoints converted at load, went
// through a call per element.
void Bf16ToF32Row(const uint16_t* s, int64_t n, float* d) {
  for (int64_t i = CpuHasAvx2() ? Bf16ToF32Avx2(s, n, d) : 0; i < n; ++i) d[i] = Bf16ToF32(s[i]);
}
void F16ToF32Row(const uint16_t* s, int64_t n, float* d) {
  for (int64_t i = CpuHasAvx2() ? F16ToF32Avx2(s, n, d) : 0; i < n; ++i) d[i] = F16ToF32(s[i]);
}

bool IsFloatDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

void LoadF32(const Tensor& t, int64_t at, int64_t n, float* dst) {
  switch (t.dtype()) {
    case DType::kF32:
      std::memcpy(dst, t.data<float>() + at, n * sizeof(float));
      return;
    case DType::kBF16: {
      return Bf16ToF32Row(t.data<uint16_t>() + at, n, dst);
    }
    case DType::kF16: {
      return F16ToF32Row(t.data<uint16_t>() + at, n, dst);
    }
    default:
      TGIS_FATAL("expected an f32, bf16 or f16 tensor, got %s", DTypeName(t.dtype()));
  }
}

std::vector<float> ToFloatVector(const Tensor& t) {
  std::vector<float> v(t.numel());
  LoadF32(t, 0, t.numel(), v.data());
  return v;
}

}  // namespace tgis::kernels::cpu

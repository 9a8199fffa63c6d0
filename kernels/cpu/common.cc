#include "kernels/cpu/common.h"

#include <immintrin.h>

#include <cstring>
#include <string>

#include "kernels/cpu/linear_stream.h"  // CpuHasAvx2: AVX2, FMA and F16C

namespace tgis::kernels::cpu {

namespace {

// 16-bit rows widened eight values at a time (both conversions are exact, so the scalar loop
// gives the same floats): the attention's per-chunk key and value rows of 16-bit caches went
// through a call per element.
__attribute__((target("avx2"))) void Bf16ToF32Avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) d[i] = Bf16ToF32(s[i]);
}
__attribute__((target("avx2,f16c"))) void F16ToF32Avx2(const uint16_t* s, int64_t n, float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = F16ToF32(s[i]);
}
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

bool IsFloatDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

void LoadF32(const Tensor& t, int64_t at, int64_t n, float* dst) {
  switch (t.dtype()) {
    case DType::kF32:
      std::memcpy(dst, t.data<float>() + at, n * sizeof(float));
      return;
    case DType::kBF16: {
      const uint16_t* s = t.data<uint16_t>() + at;
      if (CpuHasAvx2()) return Bf16ToF32Avx2(s, n, dst);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = t.data<uint16_t>() + at;
      if (CpuHasAvx2()) return F16ToF32Avx2(s, n, dst);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToF32(s[i]);
      return;
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

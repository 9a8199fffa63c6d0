// Activations and soft caps on eight lanes (AVX2/FMA): the scalar expressions of
// elementwise.cc with vector e^x, tanh and erf (vector_math_avx2.h) in place of libm's.
// Measured on the Llama shape of engine_bench as Gemma 2, where every MLP value, attention
// score and logit takes a tanh: see benchmarks/README.md, session 39.
#include <immintrin.h>

#include "kernels/cpu/vector_math_avx2.h"

namespace tgis::kernels::cpu {

namespace {

#define TGIS_ACT_AVX2 __attribute__((target("avx2,fma")))

template <Activation kKind>
TGIS_ACT_AVX2 inline __m256 Activate8(__m256 v) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  if constexpr (kKind == Activation::kRelu) {
    return _mm256_max_ps(_mm256_setzero_ps(), v);  // NaN stays NaN, as in torch.relu
  } else if constexpr (kKind == Activation::kSilu) {
    const __m256 minus_v = _mm256_xor_ps(v, _mm256_set1_ps(-0.0f));
    return _mm256_div_ps(v, _mm256_add_ps(one, Exp8(minus_v)));
  } else if constexpr (kKind == Activation::kGeluErf) {
    const __m256 e = Erf8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752440f)));
    return _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, e));
  } else {
    const __m256 cube =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v), v), v);
    const __m256 inner =
        _mm256_mul_ps(_mm256_set1_ps(0.79788456080286535588f), _mm256_add_ps(v, cube));
    return _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, Tanh8(inner)));
  }
}

// Lanes [0, n) of a tail, n in [1, 8).
TGIS_ACT_AVX2 inline __m256i TailMask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <Activation kKind>
TGIS_ACT_AVX2 void ActivateRow(const float* x, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = Activate8<kKind>(_mm256_loadu_ps(x + i));
    if (up != nullptr) a = _mm256_mul_ps(a, _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, a);
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    __m256 a = Activate8<kKind>(_mm256_maskload_ps(x + i, m));
    if (up != nullptr) a = _mm256_mul_ps(a, _mm256_maskload_ps(up + i, m));
    _mm256_maskstore_ps(out + i, m, a);
  }
}

TGIS_ACT_AVX2 inline __m256 SoftCap8(__m256 cap, __m256 v) {
  return _mm256_mul_ps(Tanh8(_mm256_div_ps(v, cap)), cap);
}

// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit). min_ps returns
// its second operand where either is NaN, so a NaN gate or up stays NaN, as torch.clamp keeps it.
TGIS_ACT_AVX2 inline __m256 ClampedSwiGlu8(__m256 alpha, __m256 limit, __m256 gate, __m256 up) {
  const __m256 g = _mm256_min_ps(limit, gate);
  const __m256 u =
      _mm256_min_ps(limit, _mm256_max_ps(_mm256_xor_ps(limit, _mm256_set1_ps(-0.0f)), up));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 minus_ag = _mm256_xor_ps(_mm256_mul_ps(alpha, g), _mm256_set1_ps(-0.0f));
  return _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_div_ps(g, _mm256_add_ps(one, Exp8(minus_ag))));
}

}  // namespace

TGIS_ACT_AVX2 void ClampedSwiGluAvx2(float alpha, float limit, const float* gate, const float* up,
                                     float* out, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha), l = _mm256_set1_ps(limit);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i,
                     ClampedSwiGlu8(a, l, _mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    _mm256_maskstore_ps(
        out + i, m,
        ClampedSwiGlu8(a, l, _mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m)));
  }
}

void ActivateAvx2(Activation kind, const float* x, const float* up, float* out, int64_t n) {
  switch (kind) {
    case Activation::kRelu:
      return ActivateRow<Activation::kRelu>(x, up, out, n);
    case Activation::kSilu:
      return ActivateRow<Activation::kSilu>(x, up, out, n);
    case Activation::kGeluErf:
      return ActivateRow<Activation::kGeluErf>(x, up, out, n);
    case Activation::kGeluTanh:
      return ActivateRow<Activation::kGeluTanh>(x, up, out, n);
  }
}

TGIS_ACT_AVX2 void SoftCapAvx2(float cap, float* x, int64_t n) {
  const __m256 c = _mm256_set1_ps(cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, SoftCap8(c, _mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i m = TailMask(n - i);
    _mm256_maskstore_ps(x + i, m, SoftCap8(c, _mm256_maskload_ps(x + i, m)));
  }
}

}  // namespace tgis::kernels::cpu

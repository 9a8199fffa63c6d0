// Internal to the CPU kernels: e^x, tanh and erf on eight f32 lanes (AVX2/FMA), for the
// attention's softmax, the activations and the soft caps. Each lane's result depends on that
// lane's input alone, so a value computed here has the same bits wherever it sits in a row.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/ops.h"

namespace tgis::kernels::cpu {

#define TGIS_VMATH_AVX2 __attribute__((target("avx2,fma"), always_inline))

// c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1] by Horner's rule, one fused multiply-add a step.
template <size_t N>
TGIS_VMATH_AVX2 inline __m256 Horner8(__m256 x, const float (&c)[N]) {
  __m256 p = _mm256_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c[i]));
  return p;
}

// e^x to about 1 ulp (Cephes' expf polynomial): lanes below -87.3 give 0 (their value is
// under FLT_MIN), lanes above 88.3 give e^88.3 (3.4e38 at most, never inf); NaN stays NaN.
TGIS_VMATH_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  static constexpr float kExp[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const __m256 y =
      _mm256_fmadd_ps(Horner8(r, kExp), _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
}

// tanh(x) within 3 ulp (2.5 measured): for |x| < 0.625 the odd series x + x^3 P(x^2) (P of degree
// 4, a weighted least-squares fit to tanh, 0.8 ulp in f32 arithmetic), above it (1 - e) / (1 + e)
// with e = e^(-2|x|), where 1 - e >= 0.71 cancels nothing; +-inf give +-1, NaN stays NaN.
TGIS_VMATH_AVX2 inline __m256 Tanh8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 s = _mm256_mul_ps(x, x);
  static constexpr float kTanh[] = {-5.717200692743063e-3f, 2.0650768652558327e-2f,
                                    -5.3743571043014526e-2f, 1.3331492245197296e-1f,
                                    -3.333328366279602e-1f};
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x, s), Horner8(s, kTanh), x);
  const __m256 e = Exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big =
      _mm256_or_ps(sign, _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

// erf(x): for |x| < 0.875 the odd series x P(x^2) (P of degree 5, a weighted least-squares
// fit to erf, 2.4 ulp in f32 arithmetic); above it Abramowitz and Stegun 7.1.26, 1 - t Q(t)
// e^(-x^2) with t = 1 / (1 + 0.3275911 |x|), within 1.5e-7 plus f32 rounding (the form
// PyTorch's vectorized erf takes everywhere), sign restored: 2.3e-7 absolute at most over
// [-6, 6] against libm's double erf. +-inf give +-1, NaN stays NaN.
TGIS_VMATH_AVX2 inline __m256 Erf8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 s = _mm256_mul_ps(x, x);
  static constexpr float kErfSmall[] = {-6.203263183124363e-4f,  5.032183136790991e-3f,
                                        -2.6791464537382126e-2f, 1.1282455176115036e-1f,
                                        -3.761255145072937e-1f,  1.1283791065216064f};
  const __m256 small = _mm256_mul_ps(x, Horner8(s, kErfSmall));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(a, _mm256_set1_ps(0.3275911f), one));
  static constexpr float kErfTail[] = {1.061405429f, -1.453152027f, 1.421413741f, -0.284496736f,
                                       0.254829592f};
  const __m256 q = Horner8(t, kErfTail);
  const __m256 e = Exp8(_mm256_xor_ps(s, _mm256_set1_ps(-0.0f)));
  const __m256 big = _mm256_or_ps(sign, _mm256_fnmadd_ps(_mm256_mul_ps(t, q), e, one));
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.875f), _CMP_LT_OQ));
}

// Row helpers (activation_avx2.cc), every element through the eight-lane functions above, a
// row's tail too (masked), so an element's bits do not depend on where a row or a thread's
// share ends. Need AVX2/FMA.
// out[i] = act(x[i]) (up null) or act(x[i]) * up[i]; out may be x.
void ActivateAvx2(Activation kind, const float* x, const float* up, float* out, int64_t n);
// x[i] = tanh(x[i] / cap) * cap.
void SoftCapAvx2(float cap, float* x, int64_t n);
// GPT-OSS's clamped SwiGLU (kernels::ClampedSwiGlu) of n gate and up values.
void ClampedSwiGluAvx2(float alpha, float limit, const float* gate, const float* up, float* out,
                       int64_t n);

}  // namespace tgis::kernels::cpu

// Rotary position embedding on CUDA, in place on q and k. The frequencies travel as a kernel
// parameter (no copy per call, so a captured decode graph stays valid), and the arithmetic
// follows HF transformers: angle = f32(position) * inv_freq in f32; cos and sin rounded to the
// activation dtype; each product and the sum rounded as PyTorch rounds them.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

namespace {

constexpr int kMaxHalf = 256;  // rotary_dim up to 512

struct InvFreq {
  float v[kMaxHalf];
};

template <typename T>
__device__ __forceinline__ void RotatePair(T* x, int i1, int i2, float c, float s) {
  const float x1 = ToF32(x[i1]), x2 = ToF32(x[i2]);
  // x * cos + rotate(x) * sin, rotate(x) = (-x2, x1) for the pair.
  const float a1 = ToF32(FromF32<T>(x1 * c)), b1 = ToF32(FromF32<T>(-x2 * s));
  const float a2 = ToF32(FromF32<T>(x2 * c)), b2 = ToF32(FromF32<T>(x1 * s));
  x[i1] = FromF32<T>(a1 + b1);
  x[i2] = FromF32<T>(a2 + b2);
}

template <typename T>
__global__ void RotaryKernel(const InvFreq inv, int half, bool neox, const void* positions,
                             bool wide, T* q, int hq, T* k, int hk, int d) {
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(LoadIndex(positions, wide, t));
  const int pairs = (hq + hk) * half;
  for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < pairs; p += gridDim.y * blockDim.x) {
    const int head = p / half, j = p % half;
    T* x = head < hq ? q + (t * hq + head) * d : k + (t * hk + (head - hq)) * d;
    const float angle = pos * inv.v[j];
    const float c = ToF32(FromF32<T>(cosf(angle))), s = ToF32(FromF32<T>(sinf(angle)));
    if (neox) {
      RotatePair(x, j, j + half, c, s);
    } else {
      RotatePair(x, 2 * j, 2 * j + 1, c, s);
    }
  }
}

}  // namespace

void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k) {
  const char* op = "Rotary";
  CheckCudaIndex(positions, op, "positions");
  CheckCudaFloat(*q, op, "q");
  CheckCudaFloat(*k, op, "k");
  TGIS_CHECK(q->rank() == 3 && k->rank() == 3 && q->dim(0) == k->dim(0) && q->dim(2) == k->dim(2) &&
                 q->dtype() == k->dtype(),
             "%s: q [T, Hq, D] and k [T, Hk, D] must agree", op);
  const int half = cfg.rotary_dim / 2;
  TGIS_CHECK(half > 0 && half <= kMaxHalf && cfg.rotary_dim <= q->dim(2) &&
                 static_cast<int>(cfg.inv_freq.size()) == half,
             "%s: rotary_dim %d does not fit head_dim %lld / inv_freq", op, cfg.rotary_dim,
             static_cast<long long>(q->dim(2)));
  const int64_t t = q->dim(0);
  TGIS_CHECK(positions.numel() == t, "%s: positions has %lld entries, want %lld", op,
             static_cast<long long>(positions.numel()), static_cast<long long>(t));
  if (t == 0) return;
  InvFreq inv{};
  for (int j = 0; j < half; ++j) inv.v[j] = cfg.inv_freq[j];
  const int hq = static_cast<int>(q->dim(1)), hk = static_cast<int>(k->dim(1));
  const int d = static_cast<int>(q->dim(2));
  // A token's pairs over several blocks: one block per token left a decode step's rotary on a
  // single SM (8 us of latency on the H100 for 2560 pairs).
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(t), Blocks((hq + hk) * half, kThreads));
  TGIS_DISPATCH_FLOAT(q->dtype(), op,
                      RotaryKernel<T><<<grid, kThreads, 0, Stream()>>>(
                          inv, half, cfg.style == RotaryStyle::kNeox, positions.raw(),
                          positions.dtype() == DType::kI64, q->data<T>(), hq, k->data<T>(), hk, d));
  TGIS_CUDA_LAUNCHED();
}

}  // namespace tgis::kernels::cuda

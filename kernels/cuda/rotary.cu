// Rotary position embedding on CUDA, in place on q and k, and fused with the split of a q|k|v
// projection and the KV cache write (QkvToCache). The frequencies travel as a kernel
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

// x * cos + partner * sin as PyTorch's elementwise ops round it: each product, then the sum,
// in T (no fused multiply-add, which nvcc would otherwise form for f32).
template <typename T>
__device__ __forceinline__ T RotatedValue(float x, float partner, float c, float s) {
  const float a = ToF32(FromF32<T>(__fmul_rn(x, c))), b = ToF32(FromF32<T>(__fmul_rn(partner, s)));
  return FromF32<T>(__fadd_rn(a, b));
}

// cos and sin of the f32 angle position * inv_freq, rounded to T (HF casts them to the dtype).
template <typename T>
__device__ __forceinline__ void RotaryAngle(float pos, float inv_freq, float* c, float* s) {
  const float angle = __fmul_rn(pos, inv_freq);
  *c = ToF32(FromF32<T>(cosf(angle)));
  *s = ToF32(FromF32<T>(sinf(angle)));
}

template <typename T>
__device__ __forceinline__ void RotatePair(T* x, int i1, int i2, float c, float s) {
  const float x1 = ToF32(x[i1]), x2 = ToF32(x[i2]);
  // x * cos + rotate(x) * sin, rotate(x) = (-x2, x1) for the pair.
  x[i1] = RotatedValue<T>(x1, -x2, c, s);
  x[i2] = RotatedValue<T>(x2, x1, c, s);
}

template <typename T>
__global__ void RotaryKernel(const InvFreq inv, int half, bool neox, const void* positions,
                             bool wide, T* q, int hq, T* k, int hk, int d) {
  PriorGridsDone();
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(LoadIndex(positions, wide, t));
  const int pairs = (hq + hk) * half;
  for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < pairs; p += gridDim.y * blockDim.x) {
    const int head = p / half, j = p % half;
    T* x = head < hq ? q + (t * hq + head) * d : k + (t * hk + (head - hq)) * d;
    float c, s;
    RotaryAngle<T>(pos, inv.v[j], &c, &s);
    if (neox) {
      RotatePair(x, j, j + half, c, s);
    } else {
      RotatePair(x, 2 * j, 2 * j + 1, c, s);
    }
  }
}

// QkvToCache: one thread per element of a token's q | k | v row, so a decode step's row of
// (Hq + 2 Hk) * D values spreads over many blocks. A rotated element reads its pair's partner
// and computes what RotatePair writes for it.
template <typename T>
__global__ void QkvToCacheKernel(const InvFreq inv, int rot, bool neox, const void* positions,
                                 bool pos_wide, const void* slots, bool slot_wide, const T* qkv,
                                 T* q, T* kc, T* vc, int hq, int hk, int d) {
  PriorGridsDone();
  const int64_t t = blockIdx.x;
  const int q_width = hq * d, kv_width = hk * d, width = q_width + 2 * kv_width;
  const int64_t slot = LoadIndex(slots, slot_wide, t);
  const float pos = rot > 0 ? static_cast<float>(LoadIndex(positions, pos_wide, t)) : 0.0f;
  const int half = rot / 2;
  const T* row = qkv + t * width;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < width; i += gridDim.y * blockDim.x) {
    const bool is_q = i < q_width, is_v = i >= q_width + kv_width;
    if (!is_q && slot < 0) continue;  // a padding row: nothing to cache
    T value = row[i];
    const int c = i % d;
    if (!is_v && c < rot) {
      const bool first = neox ? c < half : c % 2 == 0;
      const int j = neox ? (first ? c : c - half) : c / 2;
      const int partner = neox ? (first ? c + half : c - half) : (c ^ 1);
      const float other = ToF32(row[i - c + partner]);
      float cs, sn;
      RotaryAngle<T>(pos, inv.v[j], &cs, &sn);
      value = RotatedValue<T>(ToF32(value), first ? -other : other, cs, sn);
    }
    if (is_q) {
      q[t * q_width + i] = value;
    } else if (!is_v) {
      kc[slot * kv_width + (i - q_width)] = value;
    } else {
      vc[slot * kv_width + (i - q_width - kv_width)] = value;
    }
  }
}

}  // namespace

// cfg's frequencies as a kernel parameter, after checking cfg against head_dim d and the
// positions against the t rows they rotate.
InvFreq Frequencies(const RotaryConfig& cfg, int64_t d, const Tensor& positions, int64_t t,
                    const char* op) {
  CheckCudaIndex(positions, op, "positions");
  const int half = cfg.rotary_dim / 2;
  TGIS_CHECK(cfg.rotary_dim % 2 == 0 && half > 0 && half <= kMaxHalf && cfg.rotary_dim <= d &&
                 static_cast<int>(cfg.inv_freq.size()) == half,
             "%s: rotary_dim %d does not fit head_dim %lld / inv_freq", op, cfg.rotary_dim,
             static_cast<long long>(d));
  TGIS_CHECK(positions.numel() == t, "%s: positions has %lld entries, want %lld", op,
             static_cast<long long>(positions.numel()), static_cast<long long>(t));
  InvFreq inv{};
  for (int j = 0; j < half; ++j) inv.v[j] = cfg.inv_freq[j];
  return inv;
}

void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k) {
  const char* op = "Rotary";
  CheckCudaFloat(*q, op, "q");
  CheckCudaFloat(*k, op, "k");
  TGIS_CHECK(q->rank() == 3 && k->rank() == 3 && q->dim(0) == k->dim(0) && q->dim(2) == k->dim(2) &&
                 q->dtype() == k->dtype(),
             "%s: q [T, Hq, D] and k [T, Hk, D] must agree", op);
  const int half = cfg.rotary_dim / 2;
  const int64_t t = q->dim(0);
  const InvFreq inv = Frequencies(cfg, q->dim(2), positions, t, op);
  if (t == 0) return;
  const int hq = static_cast<int>(q->dim(1)), hk = static_cast<int>(k->dim(1));
  const int d = static_cast<int>(q->dim(2));
  // A token's pairs over several blocks: one block per token left a decode step's rotary on a
  // single SM (8 us of latency on the H100 for 2560 pairs).
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(t), Blocks((hq + hk) * half, kThreads));
  TGIS_DISPATCH_FLOAT(
      q->dtype(), op,
      Launch(RotaryKernel<T>, grid, kThreads, inv, half, cfg.style == RotaryStyle::kNeox,
             positions.raw(), positions.dtype() == DType::kI64, q->data<T>(), hq, k->data<T>(), hk,
             d));
}

void QkvToCache(const Tensor& qkv, const RotaryConfig* rotary, const Tensor& positions,
                const Tensor& slot_mapping, Tensor* q, KvCacheLayer* cache) {
  const char* op = "QkvToCache";
  CheckCudaFloat(qkv, op, "qkv");
  CheckCudaFloat(*q, op, "q");
  CheckCudaIndex(slot_mapping, op, "slot_mapping");
  CheckCache(*cache, qkv.dtype(), op);
  TGIS_CHECK(
      q->dtype() == qkv.dtype() && q->rank() == 3 && qkv.rank() == 2 && qkv.dim(0) == q->dim(0),
      "%s: q must be [T, Hq, D] and qkv [T, (Hq + 2 Hk) * D], of one dtype", op);
  const int64_t t = q->dim(0);
  const int hq = static_cast<int>(q->dim(1)), d = static_cast<int>(q->dim(2));
  const int hk = static_cast<int>(cache->k.dim(2));
  TGIS_CHECK(cache->k.dim(3) == d && qkv.dim(1) == static_cast<int64_t>(hq + 2 * hk) * d,
             "%s: qkv has %lld columns, want (%d + 2 x %d cache heads) x %d", op,
             static_cast<long long>(qkv.dim(1)), hq, hk, d);
  TGIS_CHECK(slot_mapping.numel() == t, "%s: slot_mapping has %lld entries, want %lld", op,
             static_cast<long long>(slot_mapping.numel()), static_cast<long long>(t));
  InvFreq inv{};
  int rot = 0;
  if (rotary != nullptr) {
    inv = Frequencies(*rotary, d, positions, t, op);
    rot = rotary->rotary_dim;
  }
  if (t == 0) return;
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(t), Blocks((hq + 2 * hk) * d, kThreads));
  TGIS_DISPATCH_FLOAT(qkv.dtype(), op,
                      Launch(QkvToCacheKernel<T>, grid, kThreads, inv, rot,
                             rotary == nullptr || rotary->style == RotaryStyle::kNeox,
                             rotary != nullptr ? positions.raw() : nullptr,
                             rotary != nullptr && positions.dtype() == DType::kI64,
                             slot_mapping.raw(), slot_mapping.dtype() == DType::kI64, qkv.data<T>(),
                             q->data<T>(), cache->k.data<T>(), cache->v.data<T>(), hq, hk, d));
}

}  // namespace tgis::kernels::cuda

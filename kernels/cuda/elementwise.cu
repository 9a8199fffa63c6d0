// Row-wise and element-wise ops on CUDA: embedding, norms, activations, residual add,
// softmax and column copies. Arithmetic in f32; results rounded to the activation dtype where
// PyTorch rounds them too (so bf16 models track HF transformers step by step).
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

namespace {

int64_t Rows(const Tensor& t) { return t.numel() / std::max<int64_t>(1, t.dim(-1)); }

// Rows whose id is outside [first, first + vocab) become zeros.
template <typename T>
__global__ void EmbeddingKernel(const void* ids, bool wide, const T* weight, int64_t first,
                                int64_t vocab, int64_t h, T* out) {
  PriorGridsDone();
  const int64_t t = blockIdx.x;
  const int64_t id = LoadIndex(ids, wide, t) - first;
  T* o = out + t * h;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < h; i += blockDim.x) o[i] = FromF32<T>(0.0f);
    return;
  }
  const T* w = weight + id * h;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) o[i] = w[i];
}

// out = RMSNorm(x) or, given y, x += y and then out = RMSNorm(x): the residual add of one
// half-layer fused with the next norm. Rows of up to kNormPerThread elements a thread (8192 at
// 1024 threads) are held in registers: every load of x, y and w is issued before the first
// store, where the loop below waits out the memory latency once per element and pass (x, y
// and out may alias, so the compiler cannot hoist those loads); on the H100 that loop took 7 us
// a row of 4096, 65 times a decode step of the 8B shape. Longer rows take the loop, which
// rereads only the elements its thread wrote. Both sum in the same order.
constexpr int kNormPerThread = 8;

template <typename T>
__global__ void RmsNormKernel(T* x, const T* y, const T* w, float eps, int64_t h, T* out) {
  PriorGridsDone();
  __shared__ float scratch[32];
  T* xr = x + blockIdx.x * h;
  T* orow = out + blockIdx.x * h;
  const T* yr = y != nullptr ? y + blockIdx.x * h : nullptr;
  // Element i of x after the residual add (written back, in x's dtype), and of the output.
  auto added = [&](int64_t i, float v, float yv) {
    if (yr == nullptr) return v;
    const T sum = FromF32<T>(v + yv);
    xr[i] = sum;
    return ToF32(sum);
  };
  // HF: weight * (x * rsqrt(...)).to(dtype): the normalized value is rounded first.
  auto normed = [](float v, float wv, float inv) {
    return FromF32<T>(wv * ToF32(FromF32<T>(v * inv)));
  };
  float ss = 0;
  if (h <= static_cast<int64_t>(blockDim.x) * kNormPerThread) {
    float v[kNormPerThread], wv[kNormPerThread], yv[kNormPerThread];
#pragma unroll
    for (int k = 0; k < kNormPerThread; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < h) {
        v[k] = ToF32(xr[i]);
        wv[k] = ToF32(w[i]);
        yv[k] = yr != nullptr ? ToF32(yr[i]) : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < kNormPerThread; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < h) {
        v[k] = added(i, v[k], yv[k]);
        ss += v[k] * v[k];
      }
    }
    const float inv = rsqrtf(BlockSum(ss, scratch) / static_cast<float>(h) + eps);
#pragma unroll
    for (int k = 0; k < kNormPerThread; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < h) orow[i] = normed(v[k], wv[k], inv);
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = added(i, ToF32(xr[i]), yr != nullptr ? ToF32(yr[i]) : 0.0f);
    ss += v * v;
  }
  const float inv = rsqrtf(BlockSum(ss, scratch) / static_cast<float>(h) + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    orow[i] = normed(ToF32(xr[i]), ToF32(w[i]), inv);
  }
}

template <typename T>
__global__ void LayerNormKernel(const T* x, const T* w, const T* b, float eps, int64_t h, T* out) {
  PriorGridsDone();
  __shared__ float scratch[32];
  const T* xr = x + blockIdx.x * h;
  T* orow = out + blockIdx.x * h;
  float sum = 0;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) sum += ToF32(xr[i]);
  const float mean = BlockSum(sum, scratch) / static_cast<float>(h);
  float var = 0;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float d = ToF32(xr[i]) - mean;
    var += d * d;
  }
  const float inv = rsqrtf(BlockSum(var, scratch) / static_cast<float>(h) + eps);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    const float bias = b != nullptr ? ToF32(b[i]) : 0.0f;
    orow[i] = FromF32<T>((ToF32(xr[i]) - mean) * inv * ToF32(w[i]) + bias);
  }
}

template <typename T>
__global__ void AddKernel(T* x, const T* y, int64_t n) {
  PriorGridsDone();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = FromF32<T>(ToF32(x[i]) + ToF32(y[i]));
  }
}

__device__ float ActivateOne(Activation kind, float v) {
  switch (kind) {
    case Activation::kRelu:
      return v < 0 ? 0.0f : v;  // NaN stays NaN, as in torch.relu
    case Activation::kSilu:
      return v / (1.0f + expf(-v));
    case Activation::kGeluErf:
      return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    case Activation::kGeluTanh:
      return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  }
  return v;
}

// out[r, c] = combine(gate_up[r, c], gate_up[r, inter + c]) over [gate | up] rows.
template <typename T, typename Combine>
__global__ void GatedKernel(const T* gate_up, int64_t inter, int64_t rows, T* out,
                            Combine combine) {
  PriorGridsDone();
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    out[i] = combine(ToF32(gate_up[r * 2 * inter + c]), ToF32(gate_up[r * 2 * inter + inter + c]));
  }
}

// HF: act(gate) * up, each a dtype tensor: the activation is rounded before the product.
template <typename T>
struct ActThenUp {
  Activation kind;
  __device__ T operator()(float g, float u) const {
    return FromF32<T>(ToF32(FromF32<T>(ActivateOne(kind, g))) * u);
  }
};

// GPT-OSS's clamped SwiGLU in transformers' order, each step a dtype tensor: sigmoid(g * alpha),
// g * it, (up + 1) * it. NaN stays NaN (torch.clamp), which fminf/fmaxf would drop.
template <typename T>
struct ClampedSwiGluOf {
  float alpha, limit;
  __device__ T operator()(float g0, float u0) const {
    const float g = g0 > limit ? limit : g0;
    const float u = u0 > limit ? limit : (u0 < -limit ? -limit : u0);
    const float ga = ToF32(FromF32<T>(g * alpha));
    const float sig = ToF32(FromF32<T>(1.0f / (1.0f + expf(-ga))));
    const float glu = ToF32(FromF32<T>(g * sig));
    return FromF32<T>(ToF32(FromF32<T>(u + 1.0f)) * glu);
  }
};

template <typename T>
__global__ void ActivateKernel(Activation kind, T* x, int64_t n) {
  PriorGridsDone();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = FromF32<T>(ActivateOne(kind, ToF32(x[i])));
  }
}

template <typename T>
__global__ void ClampKernel(float lo, float hi, T* x, int64_t n) {
  PriorGridsDone();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // NaN stays NaN, as torch.clamp has it (fminf/fmaxf alone would turn it into a bound and
    // hide a broken row from the non-finite logits check).
    const float v = ToF32(x[i]);
    x[i] = FromF32<T>(v != v ? v : fminf(fmaxf(v, lo), hi));
  }
}

template <typename T>
__global__ void SoftCapKernel(float cap, T* x, int64_t n) {
  PriorGridsDone();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = FromF32<T>(tanhf(ToF32(x[i]) / cap) * cap);
  }
}

template <typename T>
__global__ void ScaleKernel(float factor, T* x, int64_t n) {
  PriorGridsDone();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = FromF32<T>(ToF32(x[i]) * factor);
  }
}

template <typename T>
__global__ void AddWeightedRowsKernel(const T* src, const void* rows, bool wide,
                                      const float* weights, int64_t h, T* out) {
  PriorGridsDone();
  const int64_t i = blockIdx.x;
  const float w = ToF32(FromF32<T>(weights[i]));  // transformers' weights.to(dtype)
  const T* s = src + i * h;
  T* o = out + LoadIndex(rows, wide, i) * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    o[j] = FromF32<T>(ToF32(o[j]) + ToF32(FromF32<T>(ToF32(s[j]) * w)));
  }
}

template <typename T>
__global__ void SoftmaxKernel(T* x, int64_t n, bool log) {
  PriorGridsDone();
  __shared__ float scratch[32];
  T* row = x + blockIdx.x * n;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, ToF32(row[i]));
  mx = BlockMax(mx, scratch);
  float sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += expf(ToF32(row[i]) - mx);
  sum = BlockSum(sum, scratch);
  const float log_sum = logf(sum);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float z = ToF32(row[i]) - mx;
    row[i] = FromF32<T>(log ? z - log_sum : expf(z) / sum);
  }
}

// A grid-stride launch of about one thread per element, capped so huge tensors loop.
unsigned StrideBlocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(Blocks(n, 256), 65535));
}

void CheckSame(const Tensor& a, const Tensor& b, const char* op, const char* what) {
  TGIS_CHECK(a.dtype() == b.dtype(), "%s: %s is %s, the activations %s", op, what,
             DTypeName(b.dtype()), DTypeName(a.dtype()));
}

void EmbeddingRows(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out,
                   const char* op) {
  CheckCudaIndex(ids, op, "ids");
  CheckCudaFloat(weight, op, "weight");
  TGIS_CHECK(weight.rank() == 2, "%s: weight must be [V, H]", op);
  const int64_t t = ids.numel(), h = weight.dim(1);
  PrepareOut(out, {t, h}, weight.dtype(), op);
  if (t == 0) return;
  TGIS_DISPATCH_FLOAT(weight.dtype(), op,
                      Launch(EmbeddingKernel<T>, static_cast<unsigned>(t), RowThreads(h), ids.raw(),
                             ids.dtype() == DType::kI64, weight.data<T>(), first_id, weight.dim(0),
                             h, out->data<T>()));
}

// Checks gate_up [T, 2I], sizes out [T, I] and launches GatedKernel with Combine<T>{args...}.
template <template <typename> class Combine, typename... Args>
void LaunchGated(const char* op, const Tensor& gate_up, Tensor* out, Args... args) {
  CheckCudaFloat(gate_up, op, "gate_up");
  TGIS_CHECK(gate_up.rank() == 2 && gate_up.dim(1) % 2 == 0, "%s: gate_up must be [T, 2I]", op);
  const int64_t rows = gate_up.dim(0), inter = gate_up.dim(1) / 2;
  PrepareOut(out, {rows, inter}, gate_up.dtype(), op);
  if (rows * inter == 0) return;
  TGIS_DISPATCH_FLOAT(gate_up.dtype(), op,
                      Launch(GatedKernel<T, Combine<T>>, StrideBlocks(rows * inter), 256,
                             gate_up.data<T>(), inter, rows, out->data<T>(), Combine<T>{args...}));
}

}  // namespace

void Embedding(const Tensor& ids, const Tensor& weight, Tensor* out) {
  // Ids are on the device and not checked against the vocabulary here (that would need a
  // synchronization); an out-of-range id gives a zero row. The engine validates ids.
  EmbeddingRows(ids, weight, 0, out, "Embedding");
}

void EmbeddingSlice(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out) {
  EmbeddingRows(ids, weight, first_id, out, "EmbeddingSlice");
}

namespace {
// RmsNorm of x (into out, or in place), after adding y to x in place when y is given (a
// Tensor's storage is writable through a const Tensor, as for every op's `out`).
void LaunchRmsNorm(const Tensor& x, const Tensor* y, const Tensor& w, float eps, Tensor* out,
                   const char* op) {
  CheckCudaFloat(x, op, "x");
  CheckSame(x, w, op, "weight");
  if (y != nullptr) {
    CheckSame(x, *y, op, "y");
    TGIS_CHECK(x.shape() == y->shape(), "%s: x and y differ in shape", op);
  }
  const int64_t h = x.dim(-1);
  TGIS_CHECK(w.numel() == h, "%s: weight has %lld elements, want %lld", op,
             static_cast<long long>(w.numel()), static_cast<long long>(h));
  if (out != &x) PrepareOut(out, x.shape(), x.dtype(), op);
  const int64_t rows = Rows(x);
  if (rows == 0) return;
  TGIS_DISPATCH_FLOAT(
      x.dtype(), op,
      Launch(RmsNormKernel<T>, static_cast<unsigned>(rows), RowThreads(h), x.data<T>(),
             y != nullptr ? y->data<T>() : nullptr, w.data<T>(), eps, h, out->data<T>()));
}
}  // namespace

void RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor* out) {
  LaunchRmsNorm(x, nullptr, w, eps, out, "RmsNorm");
}

void AddRmsNorm(Tensor* x, const Tensor& y, const Tensor& w, float eps, Tensor* out) {
  LaunchRmsNorm(*x, &y, w, eps, out, "AddRmsNorm");
}

void LayerNorm(const Tensor& x, const Tensor& w, const Tensor* bias, float eps, Tensor* out) {
  const char* op = "LayerNorm";
  CheckCudaFloat(x, op, "x");
  CheckSame(x, w, op, "weight");
  const bool has_bias = bias != nullptr && bias->defined();
  if (has_bias) CheckSame(x, *bias, op, "bias");
  const int64_t h = x.dim(-1);
  TGIS_CHECK(w.numel() == h && (!has_bias || bias->numel() == h), "%s: weight/bias size", op);
  if (out != &x) PrepareOut(out, x.shape(), x.dtype(), op);
  const int64_t rows = Rows(x);
  if (rows == 0) return;
  TGIS_DISPATCH_FLOAT(
      x.dtype(), op,
      Launch(LayerNormKernel<T>, static_cast<unsigned>(rows), RowThreads(h), x.data<T>(),
             w.data<T>(), has_bias ? bias->data<T>() : nullptr, eps, h, out->data<T>()));
}

void AddInPlace(Tensor* x, const Tensor& y) {
  const char* op = "AddInPlace";
  CheckCudaFloat(*x, op, "x");
  CheckSame(*x, y, op, "y");
  TGIS_CHECK(x->numel() == y.numel(), "%s: sizes differ", op);
  const int64_t n = x->numel();
  if (n == 0) return;
  TGIS_DISPATCH_FLOAT(x->dtype(), op,
                      Launch(AddKernel<T>, StrideBlocks(n), 256, x->data<T>(), y.data<T>(), n));
}

void GatedActivation(Activation kind, const Tensor& gate_up, Tensor* out) {
  LaunchGated<ActThenUp>("GatedActivation", gate_up, out, kind);
}

void ClampedSwiGlu(const Tensor& gate_up, float alpha, float limit, Tensor* out) {
  LaunchGated<ClampedSwiGluOf>("ClampedSwiGlu", gate_up, out, alpha, limit);
}

void Activate(Activation kind, Tensor* x) {
  const char* op = "Activate";
  CheckCudaFloat(*x, op, "x");
  const int64_t n = x->numel();
  if (n == 0) return;
  TGIS_DISPATCH_FLOAT(x->dtype(), op,
                      Launch(ActivateKernel<T>, StrideBlocks(n), 256, kind, x->data<T>(), n));
}

void Clamp(float lo, float hi, Tensor* x) {
  const char* op = "Clamp";
  CheckCudaFloat(*x, op, "x");
  const int64_t n = x->numel();
  if (n == 0) return;
  TGIS_DISPATCH_FLOAT(x->dtype(), op,
                      Launch(ClampKernel<T>, StrideBlocks(n), 256, lo, hi, x->data<T>(), n));
}

void SoftCap(float cap, Tensor* x) {
  const char* op = "SoftCap";
  CheckCudaFloat(*x, op, "x");
  const int64_t n = x->numel();
  if (n == 0) return;
  TGIS_DISPATCH_FLOAT(x->dtype(), op,
                      Launch(SoftCapKernel<T>, StrideBlocks(n), 256, cap, x->data<T>(), n));
}

void Scale(float factor, Tensor* x) {
  const char* op = "Scale";
  CheckCudaFloat(*x, op, "x");
  const int64_t n = x->numel();
  if (n == 0) return;
  TGIS_DISPATCH_FLOAT(x->dtype(), op,
                      Launch(ScaleKernel<T>, StrideBlocks(n), 256, factor, x->data<T>(), n));
}

// Rows are distinct (the contract): one block a row, no two blocks write the same one.
void AddWeightedRows(const Tensor& src, const Tensor& rows, const Tensor& weights, Tensor* out) {
  const char* op = "AddWeightedRows";
  CheckCudaFloat(src, op, "src");
  CheckSame(src, *out, op, "out");
  CheckCudaIndex(rows, op, "rows");
  TGIS_CHECK(weights.device() == Device::kCuda && weights.dtype() == DType::kF32,
             "%s: weights must be f32 on the device", op);
  TGIS_CHECK(src.rank() == 2 && out->rank() == 2 && src.dim(1) == out->dim(1),
             "%s: src [N, H] and out [T, H] must share H", op);
  const int64_t n = src.dim(0), h = src.dim(1);
  TGIS_CHECK(rows.numel() == n && weights.numel() == n, "%s: want one row index and weight per row",
             op);
  if (n == 0 || h == 0) return;
  TGIS_DISPATCH_FLOAT(
      src.dtype(), op,
      Launch(AddWeightedRowsKernel<T>, static_cast<unsigned>(n), RowThreads(h), src.data<T>(),
             rows.raw(), rows.dtype() == DType::kI64, weights.data<float>(), h, out->data<T>()));
}

namespace {
void SoftmaxRows(Tensor* x, bool log, const char* op) {
  CheckCudaFloat(*x, op, "x");
  const int64_t n = x->dim(-1), rows = Rows(*x);
  if (rows == 0 || n == 0) return;
  TGIS_DISPATCH_FLOAT(
      x->dtype(), op,
      Launch(SoftmaxKernel<T>, static_cast<unsigned>(rows), RowThreads(n), x->data<T>(), n, log));
}
}  // namespace

void Softmax(Tensor* x) { SoftmaxRows(x, false, "Softmax"); }
void LogSoftmax(Tensor* x) { SoftmaxRows(x, true, "LogSoftmax"); }

void CopyColumns(const Tensor& src, int64_t src_col, int64_t ncols, Tensor* dst, int64_t dst_col) {
  const char* op = "CopyColumns";
  TGIS_CHECK(src.rank() == 2 && dst->rank() == 2 && src.dim(0) == dst->dim(0) &&
                 src.dtype() == dst->dtype(),
             "%s: src and dst must be 2-d with the same rows and dtype", op);
  TGIS_CHECK(0 <= src_col && src_col + ncols <= src.dim(1) && 0 <= dst_col &&
                 dst_col + ncols <= dst->dim(1),
             "%s: columns out of range", op);
  const size_t es = DTypeSize(src.dtype());
  if (ncols == 0 || src.dim(0) == 0) return;
  TGIS_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst->raw()) + dst_col * es, dst->dim(1) * es,
                                    static_cast<const char*>(src.raw()) + src_col * es,
                                    src.dim(1) * es, ncols * es, static_cast<size_t>(src.dim(0)),
                                    cudaMemcpyDeviceToDevice, Stream()));
}

}  // namespace tgis::kernels::cuda

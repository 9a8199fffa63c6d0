// Token choice on the GPU: the logits stay on the device and only ids and logprobs come back.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

namespace {

__global__ void BanKernel(float* logits, int64_t v, const void* banned, bool wide, int m) {
  const int64_t r = blockIdx.x;
  for (int j = threadIdx.x; j < m; j += blockDim.x) {
    const int64_t t = LoadIndex(banned, wide, r * m + j);
    if (0 <= t && t < v) logits[r * v + t] = -INFINITY;
  }
}

// (value, index) with the larger value winning, the smaller index on ties: torch.argmax's and
// std::max_element's "first maximum".
__device__ __forceinline__ void Better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__global__ void GreedyKernel(const float* logits, int64_t v, int* ids, float* logprobs) {
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  __shared__ float scratch[32];
  const float* x = logits + blockIdx.x * v;
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  int bad = 0;  // a NaN or +inf: the row has no choice (GreedyPick's contract)
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    bad |= isnan(x[i]) || x[i] == INFINITY;
    Better(bv, bi, x[i], static_cast<int>(i));
  }
  bad = __syncthreads_or(bad);
  for (int o = 16; o > 0; o >>= 1) {
    Better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    best_v[warp] = bv;
    best_i[warp] = bi;
  }
  __syncthreads();
  bv = lane < warps ? best_v[lane] : -INFINITY;
  bi = lane < warps ? best_i[lane] : 0x7fffffff;
  for (int o = 16; o > 0; o >>= 1) {
    Better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  }
  float sum = 0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) sum += expf(x[i] - bv);
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = bad ? -1 : bi;
    logprobs[blockIdx.x] = bad ? NAN : -logf(sum);
  }
}

}  // namespace

void GreedyPick(Tensor* logits, const Tensor& banned, Tensor* ids, Tensor* logprobs) {
  const char* op = "GreedyPick";
  TGIS_CHECK(logits->defined() && logits->device() == Device::kCuda &&
                 logits->dtype() == DType::kF32 && logits->rank() == 2,
             "%s: logits must be CUDA f32 [R, V]", op);
  const int64_t rows = logits->dim(0), v = logits->dim(1);
  PrepareOut(ids, {rows}, DType::kI32, op);
  PrepareOut(logprobs, {rows}, DType::kF32, op);
  if (rows == 0) return;
  if (banned.defined() && banned.numel() > 0) {
    CheckCudaIndex(banned, op, "banned");
    TGIS_CHECK(banned.rank() == 2 && banned.dim(0) == rows, "%s: banned must be [R, M]", op);
    BanKernel<<<static_cast<unsigned>(rows), 32, 0, Stream()>>>(
        logits->data<float>(), v, banned.raw(), banned.dtype() == DType::kI64,
        static_cast<int>(banned.dim(1)));
    TGIS_CUDA_LAUNCHED();
  }
  GreedyKernel<<<static_cast<unsigned>(rows), 1024, 0, Stream()>>>(
      logits->data<float>(), v, ids->data<int>(), logprobs->data<float>());
  TGIS_CUDA_LAUNCHED();
}

}  // namespace tgis::kernels::cuda

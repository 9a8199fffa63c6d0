// Token choice on the GPU: the logits stay on the device and only ids and logprobs come back.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

// After the primitives it uses (common.cuh).
#include "kernels/cuda/top_logits.cuh"

namespace tgis::kernels::cuda {

namespace {

__global__ void BanKernel(float* logits, int64_t v, const void* banned, bool wide, int m) {
  PriorGridsDone();
  const int64_t r = blockIdx.x;
  for (int j = threadIdx.x; j < m; j += blockDim.x) {
    const int64_t t = LoadIndex(banned, wide, r * m + j);
    if (0 <= t && t < v) logits[r * v + t] = -INFINITY;
  }
}

__global__ void RepetitionPenaltyKernel(float* logits, int64_t v, const void* tokens, bool wide,
                                        int m, const float* penalties) {
  PriorGridsDone();
  const int64_t r = blockIdx.x;
  const float p = penalties[r];
  if (p == 1.0f) return;
  for (int j = threadIdx.x; j < m; j += blockDim.x) {
    const int64_t t = LoadIndex(tokens, wide, r * m + j);
    if (t < 0 || t >= v) continue;
    float& x = logits[r * v + t];  // a row's tokens are distinct: one thread per logit
    x = x < 0 ? __fmul_rn(x, p) : __fdiv_rn(x, p);
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

// Greedy over a row of V logits in two passes, so that a 128K vocabulary is read by many SMs
// rather than one (one block per row took 92 us of a 9 ms decode step on the H100). Pass 1:
// block p of row r takes columns [p * span, (p + 1) * span): its first maximum, the sum of
// exp(x - that maximum), and whether it saw a NaN or +inf. Pass 2: one warp per row combines
// the parts in column order. The split depends on V alone, so a row's result does not depend
// on the batch it came in.
constexpr int kGreedyParts = 64;
constexpr int kGreedyMinSpan = 2048;

struct GreedyPart {
  float max, sum;
  int index, bad;
};

__global__ void GreedyPartKernel(const float* logits, int64_t v, int64_t span, GreedyPart* parts) {
  PriorGridsDone();
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  __shared__ float scratch[32];
  const float* x = logits + blockIdx.y * v;
  const int64_t begin = blockIdx.x * span, end = min(v, begin + span);
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  int bad = 0;  // a NaN or +inf: the row has no choice (GreedyPick's contract)
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
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
  if (bv != -INFINITY) {
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) sum += expf(x[i] - bv);
  }
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) parts[blockIdx.y * gridDim.x + blockIdx.x] = {bv, sum, bi, bad};
}

__global__ void GreedyCombineKernel(const GreedyPart* parts, int count, int* ids, float* logprobs) {
  PriorGridsDone();
  const GreedyPart* row = parts + blockIdx.x * count;
  float bv = -INFINITY;
  int bi = 0x7fffffff, bad = 0;
  for (int p = threadIdx.x; p < count; p += 32) {
    Better(bv, bi, row[p].max, row[p].index);
    bad |= row[p].bad;
  }
  for (int o = 16; o > 0; o >>= 1) {
    Better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
  // Each part's sum rescaled to the row's maximum: sum over the row of exp(x - max).
  float sum = 0;
  for (int p = threadIdx.x; p < count; p += 32) {
    if (row[p].max != -INFINITY) sum += row[p].sum * expf(row[p].max - bv);
  }
  sum = WarpSum(sum);
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = bad ? -1 : (bi == 0x7fffffff ? 0 : bi);
    // A row of -inf only (everything banned) has no logprob, as on the CPU.
    logprobs[blockIdx.x] = bad || bv == -INFINITY ? NAN : -logf(sum);
  }
}

}  // namespace

void RepetitionPenalty(Tensor* logits, const Tensor& tokens, const Tensor& penalties) {
  const char* op = "RepetitionPenalty";
  TGIS_CHECK(logits->defined() && logits->device() == Device::kCuda &&
                 logits->dtype() == DType::kF32 && logits->rank() == 2,
             "%s: logits must be CUDA f32 [R, V]", op);
  CheckCudaIndex(tokens, op, "tokens");
  TGIS_CHECK(penalties.defined() && penalties.device() == Device::kCuda &&
                 penalties.dtype() == DType::kF32 && penalties.numel() == logits->dim(0) &&
                 tokens.rank() == 2 && tokens.dim(0) == logits->dim(0),
             "%s: tokens [R, M] and CUDA f32 penalties [R]", op);
  const int64_t rows = logits->dim(0);
  if (rows == 0 || tokens.dim(1) == 0) return;
  Launch(RepetitionPenaltyKernel, static_cast<unsigned>(rows), 256, logits->data<float>(),
         logits->dim(1), tokens.raw(), tokens.dtype() == DType::kI64,
         static_cast<int>(tokens.dim(1)), penalties.data<float>());
}

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
    Launch(BanKernel, static_cast<unsigned>(rows), 32, logits->data<float>(), v, banned.raw(),
           banned.dtype() == DType::kI64, static_cast<int>(banned.dim(1)));
  }
  const int64_t count =
      std::clamp<int64_t>((v + kGreedyMinSpan - 1) / kGreedyMinSpan, 1, kGreedyParts);
  const int64_t span = (v + count - 1) / count;
  Tensor parts = Tensor::Empty({rows, count, static_cast<int64_t>(sizeof(GreedyPart))}, DType::kU8,
                               Device::kCuda);
  auto* part = reinterpret_cast<GreedyPart*>(parts.raw());
  Launch(GreedyPartKernel, dim3(static_cast<unsigned>(count), static_cast<unsigned>(rows)), 256,
         logits->data<float>(), v, span, part);
  Launch(GreedyCombineKernel, static_cast<unsigned>(rows), 32, part, static_cast<int>(count),
         ids->data<int>(), logprobs->data<float>());
}

void TopLogits(const Tensor& logits, const Tensor& rows, const Tensor& temperatures, int64_t count,
               Tensor* values, Tensor* ids, Tensor* stats) {
  const char* op = "TopLogits";
  TGIS_CHECK(logits.defined() && logits.device() == Device::kCuda &&
                 logits.dtype() == DType::kF32 && logits.rank() == 2,
             "%s: logits must be CUDA f32 [R, V]", op);
  TGIS_CHECK(rows.defined() && rows.device() == Device::kCuda && rows.dtype() == DType::kI32 &&
                 temperatures.defined() && temperatures.device() == Device::kCuda &&
                 temperatures.dtype() == DType::kF32 && temperatures.numel() == rows.numel(),
             "%s: rows [S] i32 and temperatures [S] f32, on CUDA", op);
  const int64_t s = rows.numel(), v = logits.dim(1);
  TGIS_CHECK(count >= 1 && count <= v && v <= 0x7fffffff, "%s: count %lld outside [1, %lld]", op,
             static_cast<long long>(count), static_cast<long long>(v));
  PrepareOut(values, {s, count}, DType::kF32, op);
  PrepareOut(ids, {s, count}, DType::kI32, op);
  PrepareOut(stats, {s, 2}, DType::kF32, op);
  if (s == 0) return;
  Launch(TopLogitsKernel, static_cast<unsigned>(s), kTopThreads, logits.data<float>(), v,
         rows.data<int>(), temperatures.data<float>(), static_cast<int>(count),
         values->data<float>(), ids->data<int>(), stats->data<float>());
}

}  // namespace tgis::kernels::cuda

// Internal: what every CUDA kernel file shares: error checks, the one stream all work is
// queued on, element types and their f32 conversions, and the dtype dispatch.
//
// Kernels are templated on the element type only (float, bf16, f16: three instances each);
// sizes such as the head dimension stay run-time values, so the build does not multiply.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "kernels/check.h"
#include "kernels/cuda/warp_reduce.cuh"
#include "kernels/ops.h"
#include "kernels/tensor.h"

#define TGIS_CUDA_CHECK(expr)                                                             \
  do {                                                                                    \
    const cudaError_t tgis_err_ = (expr);                                                 \
    TGIS_CHECK(tgis_err_ == cudaSuccess, "%s: %s", #expr, cudaGetErrorString(tgis_err_)); \
  } while (0)

namespace tgis::kernels::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

// The stream every kernel, copy and GEMM of this process runs on, in order. One stream keeps
// the host code free of events; it is a non-default stream so that decode steps can be
// captured into CUDA graphs.
cudaStream_t Stream();
// Makes the shard's GPU (SetDevice) the calling thread's current device, once per thread. The
// CUDA runtime's current device is per host thread, and the gRPC workers that run steps are
// not the thread that chose the GPU: without this they would run on device 0. Stream() calls
// it, so every launch and copy is covered; code that touches CUDA before asking for the
// stream (handle creation, memory queries) calls it first.
void BindThread();

// Programmatic dependent launch (Hopper and later): Launch lets a kernel's blocks start while
// the kernel before it on the stream is still running, and the kernel calls PriorGridsDone
// before it touches anything an earlier kernel writes or reads. That call waits for the
// earlier kernels to complete (their memory visible) and lets the next kernel launch. A decode
// step is ~300 kernels, many of them a few microseconds: the launch gap and each GEMV's ramp
// up to the HBM's rate came between every two. Before the call a kernel may only read what the
// kernel before it does not write (every earlier one has finished by then: that kernel passed
// its own call before this one could start): the GEMVs issue their first weight loads there, so
// those are in flight while the norm or attention before them finishes.
//
// Every kernel calls PriorGridsDone on every path, early returns included: a kernel that ended
// without waiting would let the kernel after it overtake the one before. On older GPUs (and
// when SetGpuProgrammaticLaunch turned it off) kernels launch in plain stream order and the
// call does nothing.
__device__ __forceinline__ void PriorGridsDone() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks the L2 to fetch the 128-byte line at p (global memory) ahead of its loads.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Whether Launch asks for programmatic dependent launch: the GPU has it (compute capability 9
// or more) and SetGpuProgrammaticLaunch has not turned it off.
bool ProgrammaticLaunch();

// kernel<<<grid, block, 0, Stream()>>>(args...), with programmatic dependent launch where
// ProgrammaticLaunch() says so. Launch errors are fatal (configuration errors: a bug); faults
// show up at the next synchronization.
template <typename... Params, typename... Args>
void Launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = Stream();
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  if (ProgrammaticLaunch()) {
    config.attrs = &overlap;
    config.numAttrs = 1;
  }
  TGIS_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename T>
__device__ __forceinline__ float ToF32(T v);
template <>
__device__ __forceinline__ float ToF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToF32<bf16>(bf16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToF32<f16>(f16 v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 FromF32<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ f16 FromF32<f16>(float v) {
  return __float2half_rn(v);
}

// Element i of an i32 or i64 index tensor (the kernels take both; `wide` says which).
__device__ __forceinline__ int64_t LoadIndex(const void* p, bool wide, int64_t i) {
  return wide ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Sum and max over a block (blockDim.x a multiple of 32, at most 1024). Every thread gets the
// result. `scratch` is 32 floats of shared memory, reusable after the call returns.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = kMax ? WarpMax(v) : WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
  return kMax ? WarpMax(v) : WarpSum(v);
}
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  return BlockReduce<false>(v, scratch);
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  return BlockReduce<true>(v, scratch);
}

// Threads per block for a row of n elements: a multiple of 32 up to 1024.
inline int RowThreads(int64_t n) {
  int t = 32;
  while (t < 1024 && t < n) t <<= 1;
  return t;
}

inline unsigned Blocks(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

bool IsFloat(DType t);
// Checks that t is a defined CUDA tensor of a float dtype.
void CheckCudaFloat(const Tensor& t, const char* op, const char* what);
// Checks that t is a defined CUDA tensor of i32 or i64.
void CheckCudaIndex(const Tensor& t, const char* op, const char* what);
// Checks that a layer's paged cache is two CUDA [num_blocks, block_size, Hk, D] tensors of the
// activations' dtype.
void CheckCache(const KvCacheLayer& cache, DType act, const char* op);
// Allocates *out (dtype, CUDA) when undefined; otherwise checks shape, dtype and device.
void PrepareOut(Tensor* out, const Shape& shape, DType dtype, const char* op);

}  // namespace tgis::kernels::cuda

// Runs the statement with `T` bound to the element type of float dtype `dtype`.
#define TGIS_DISPATCH_FLOAT(dtype, op, ...)                                            \
  do {                                                                                 \
    switch (dtype) {                                                                   \
      case ::tgis::kernels::DType::kF32: {                                             \
        using T = float;                                                               \
        __VA_ARGS__;                                                                   \
        break;                                                                         \
      }                                                                                \
      case ::tgis::kernels::DType::kBF16: {                                            \
        using T = ::tgis::kernels::cuda::bf16;                                         \
        __VA_ARGS__;                                                                   \
        break;                                                                         \
      }                                                                                \
      case ::tgis::kernels::DType::kF16: {                                             \
        using T = ::tgis::kernels::cuda::f16;                                          \
        __VA_ARGS__;                                                                   \
        break;                                                                         \
      }                                                                                \
      default:                                                                         \
        TGIS_FATAL("%s: unsupported dtype %s", op, ::tgis::kernels::DTypeName(dtype)); \
    }                                                                                  \
  } while (0)

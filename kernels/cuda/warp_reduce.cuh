// Internal: sum and max over the 32 lanes of a warp (every lane gets the result), through
// __shfl_xor_sync: CUDA's in the build (common.cuh includes this), the warp emulator's in
// tests/unit/warp_emulator.h.
#pragma once

namespace tgis::kernels::cuda {

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace tgis::kernels::cuda

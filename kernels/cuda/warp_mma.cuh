// Internal: the warp-level pieces of the tensor-core kernels (mma.m16n8k16 with f32
// accumulators, ldmatrix, and the 32-bit register pairs its 16-bit operands travel in). The warp
// emulator of tests/unit/warp_emulator.h gives the same functions on the CPU.
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace tgis::kernels::cuda {

// Two 16-bit elements as one register, `lo` in the low half: the order of mma's operands.
template <typename T>
__device__ __forceinline__ uint32_t JoinHalves(T lo, T hi);
template <>
__device__ __forceinline__ uint32_t JoinHalves<bf16>(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}
template <>
__device__ __forceinline__ uint32_t JoinHalves<f16>(f16 lo, f16 hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) |
         (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}

// The bits of the value 2^e in T where 2^e + m is exact for every integer 0 <= m < 2^e (the
// mantissa's width): 128 in bf16, 1024 in f16. OR-ing a small integer into its low bits makes
// that integer plus 2^e without a conversion.
template <typename T>
__device__ __forceinline__ constexpr uint32_t HalfMagicBits();
template <>
__device__ __forceinline__ constexpr uint32_t HalfMagicBits<bf16>() {
  return 0x4300u;
}
template <>
__device__ __forceinline__ constexpr uint32_t HalfMagicBits<f16>() {
  return 0x6400u;
}

// The two T halves of a less those of b, each rounded to T.
template <typename T>
__device__ __forceinline__ uint32_t SubHalves(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t SubHalves<bf16>(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t SubHalves<f16>(uint32_t a, uint32_t b) {
  const __half2 r =
      __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Elements p[0] and p[1] (4-byte aligned) as one register.
template <typename T>
__device__ __forceinline__ uint32_t LoadPair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// 16 bytes, both ends 16-byte aligned.
__device__ __forceinline__ void Copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void Zero16(void* dst) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80):
// the copies of a thread since its last CpAsyncCommit form a group, and CpAsyncWait<N> returns
// once at most N of its groups are still in flight. Other threads' copies are visible after a
// __syncthreads that follows their wait.
__device__ __forceinline__ void CpAsync16(void* shared, const void* global) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(global));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements from shared memory, one register of each per lane:
// lanes 8m..8m+7 give the addresses of matrix m's rows (16 bytes each, 16-byte aligned), and
// lane l gets row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each matrix (ldmatrix), or, in
// the Trans form, rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4: mma's B fragments of a
// row-major [k][n] tile.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}

// d += a . b for a 16x16 A (row major: four registers per lane) and a 16x8 B (column major:
// two), f32 accumulators (four per lane), in the PTX ISA's fragment layouts. Needs sm_80.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void Mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // the host side only launches this kernel on sm_80 and newer
#endif
}
template <>
__device__ __forceinline__ void Mma16816<f16>(float (&d)[4], const uint32_t (&a)[4],
                                              const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

}  // namespace tgis::kernels::cuda

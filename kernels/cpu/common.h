// Internal helpers shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/check.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cpu {

// Allocates *out (f32, CPU) when undefined; otherwise checks it has `shape`, f32 and the CPU.
void PrepareOut(Tensor* out, const Shape& shape, const char* op);

// Checks that t is a defined f32 CPU tensor.
void CheckF32(const Tensor& t, const char* op, const char* what);

// Element i of an i32 or i64 tensor.
inline int64_t IndexAt(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kI64 ? t.data<int64_t>()[i] : t.data<int32_t>()[i];
}
void CheckIndexTensor(const Tensor& t, const char* op, const char* what);

// Converts n values of a float tensor (f32, bf16 or f16) starting at element `at` to f32.
void LoadF32(const Tensor& t, int64_t at, int64_t n, float* dst);
// n bf16 or f16 values widened to f32 (exact), eight at a time where the CPU has AVX2.
void Bf16ToF32Row(const uint16_t* src, int64_t n, float* dst);
void F16ToF32Row(const uint16_t* src, int64_t n, float* dst);

// Whether kernels may use AVX2/FMA now: the CPU has it and SetIsaForTesting allows it
// (linear.cc owns the switch).
bool UseAvx2Kernels();
// A small float tensor (norm weights, biases) as an f32 vector.
std::vector<float> ToFloatVector(const Tensor& t);

bool IsFloatDType(DType t);

}  // namespace tgis::kernels::cpu

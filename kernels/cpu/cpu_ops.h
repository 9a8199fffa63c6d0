// Internal: the CPU implementations of the ops in ops.h (same contracts), called by the
// dispatcher in ops.cc, plus hooks for tests and benchmarks.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cpu {

#include "kernels/op_signatures.inc"

// Which Linear code path runs: kAuto picks AVX2/FMA when the CPU has it. Tests force kScalar
// to cover the fallback; not thread-safe against concurrent Linear calls.
enum class Isa { kAuto, kScalar, kAvx2 };
void SetIsaForTesting(Isa isa);
// The path kAuto resolves to on this machine ("avx2+fma" or "scalar").
const char* ActiveIsaName();

}  // namespace tgis::kernels::cpu

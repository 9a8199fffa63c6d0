// Internal: the CPU implementations of the ops in ops.h (same contracts), called by the
// dispatcher in ops.cc, plus hooks for tests and benchmarks.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cpu {

#include "kernels/op_signatures.inc"

// Which Linear code path runs: kAuto picks AVX-512 when the CPU has it (for the weights that
// kernel takes), else AVX2/FMA, else scalar. Tests force the others to cover every path; not
// thread-safe against concurrent Linear calls.
enum class Isa { kAuto, kScalar, kAvx2, kAvx512 };
void SetIsaForTesting(Isa isa);
// Whether this CPU can run `isa`'s path (kAuto and kScalar always can).
bool IsaAvailable(Isa isa);
// The path kAuto resolves to on this machine ("avx512", "avx2+fma" or "scalar").
const char* ActiveIsaName();

}  // namespace tgis::kernels::cpu

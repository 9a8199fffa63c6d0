// Internal: the CPU implementations of the ops in ops.h (same contracts), called by the
// dispatcher in ops.cc, plus hooks for tests and benchmarks.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cpu {

#include "kernels/op_signatures.inc"

// Which Linear code path runs: kAuto picks the best the CPU has: AVX-512 with VNNI (integer
// dot products for 8-bit codes) and AVX512_BF16 (bf16 weights against x rounded to bf16),
// AVX-512, AVX2/FMA, scalar; each AVX-512 path only for the weights it takes, AVX2 for
// the others. Tests force each path in turn; not thread-safe against concurrent Linear calls.
enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Vnni, kAvx512Bf16 };
void SetIsaForTesting(Isa isa);
// Whether this CPU can run `isa`'s path (kAuto and kScalar always can).
bool IsaAvailable(Isa isa);
// The path the benchmarks' --isa names: scalar, avx2, avx512, vnni or bf16; kAuto for any other.
Isa IsaNamed(std::string_view name);
// Whether Linear, as set now, multiplies x rounded to bf16 (to nearest even) for weights of
// dtype `w` and k columns: bf16 weights with AVX512_BF16 (k even), at every T.
bool Bf16DotTakes(DType w, int64_t k);
// Opt-in, process-wide: 8- and 4-bit codes are multiplied by x rounded to int8 per 32 columns
// (llama.cpp's way), where the weight's runs allow it: with AVX2 code on the 8-row panels at
// every T (linear_int8_panels.cc; 4-bit decode on every CPU), with AVX-512 VNNI on the rows
// where the CPU has it (linear_q8_int8x.cc for 8-bit decode, linear_int8_gemm.cc for prefill).
// Other weights (float, fp8) stay exact.
void SetInt8Activations(bool on);
bool Int8ActivationsAvailable();
// Derives now the layouts the current settings' kernels read from `q` (ops.h's
// PrepareCpuWeight). True when every kernel path for `q` reads them, so that its row-major
// codes may go.
bool PrepareQuantized(const QuantizedWeight& q);
// Bytes of memory those derived layouts hold now (ops.h's CpuDerivedLayoutBytes).
size_t DerivedLayoutBytes();

// The path kAuto resolves to on this machine ("avx512+vnni+bf16", "avx512+vnni", "avx512",
// "avx2+fma", "scalar").
const char* ActiveIsaName();

// What runs prefill's matrix products (T above the streaming kernels'): "avx512" (ours), or
// "OpenBLAS <its kernel family>" (loading OpenBLAS to ask it).
std::string PrefillGemmName();

}  // namespace tgis::kernels::cpu

// Internal: OpenBLAS, loaded with dlopen at first use rather than linked.
//
// Why: OpenBLAS's run-time CPU detection (DYNAMIC_ARCH) runs in its library constructor, and
// the builds distributions ship fall back to its SSE3 "Prescott" kernels on CPUs newer than
// the build knows. Debian 12's 0.3.21 does so on Emerald Rapids (measured: prefill of a
// 1.1B model at 27 tok/s against 102 with the AVX-512 kernels). OPENBLAS_CORETYPE, read by
// that constructor, selects the kernels; loading the library ourselves lets us set it first
// from what this CPU can run, unless the operator has set it.
#pragma once

#include <string>

namespace tgis::kernels::cpu {

// C = A[M, K] @ B[N, K]^T (row major, single-threaded: our pool supplies the threads).
// Loads OpenBLAS on first use; a missing library is fatal and says which file it looked for.
void SgemmNT(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
             int ldc);

// The kernel family OpenBLAS is using ("SkylakeX", "Haswell", ...); loads it if needed.
std::string BlasCoreName();

// The OPENBLAS_CORETYPE we set when the operator has not: the best family this CPU runs
// (AMD with AVX2/FMA: Zen, also on Zen 4's AVX-512, but SkylakeX from Zen 5 (family 0x1A)
// on, whose AVX-512 units are 512 bits wide; Intel with AVX-512 F/BW/VL/DQ/CD: SkylakeX;
// AVX2/FMA: Haswell), or "" to leave the choice to OpenBLAS.
std::string PreferredBlasCore();

// The CPU's family as cpuid leaf 1 gives it (base family, plus the extended family when the
// base is 0xF: AMD Zen 3 and 4 are 0x19, Zen 5 0x1A); 0 if cpuid has no leaf 1.
int CpuFamily();

}  // namespace tgis::kernels::cpu

// OpenBLAS is loaded with the kernel family this CPU runs (kernels/cpu/blas.h), or the one the
// operator chose with OPENBLAS_CORETYPE; ctest runs this file twice, once with
// OPENBLAS_CORETYPE=Haswell in the environment.
#include <gtest/gtest.h>
#include <strings.h>

#include <cstdlib>
#include <string>

#include "kernels/cpu/blas.h"
#include "kernels/cpu/cpu_ops.h"

namespace tgis::kernels::cpu {
namespace {

// The environment as the process started, before loading OpenBLAS set anything.
const char* const kOperatorCoretype = [] {
  const char* v = std::getenv("OPENBLAS_CORETYPE");
  return v != nullptr ? strdup(v) : nullptr;
}();

TEST(CpuBlas, RunsTheKernelsThisCpuCanRunOrTheOperatorsChoice) {
  if (kOperatorCoretype != nullptr && !IsaAvailable(Isa::kAvx2)) {
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << kOperatorCoretype << " on a CPU without AVX2";
  }
  const std::string want =
      kOperatorCoretype != nullptr ? std::string(kOperatorCoretype) : PreferredBlasCore();
  const std::string core = BlasCoreName();
  if (want.empty()) {
    EXPECT_FALSE(core.empty());  // no AVX2: OpenBLAS's own choice
    return;
  }
  // Without the override, Debian's OpenBLAS 0.3.21 runs "Prescott" (SSE3) kernels on CPUs it
  // does not know, such as Emerald Rapids.
  EXPECT_EQ(strcasecmp(core.c_str(), want.c_str()), 0) << "OpenBLAS runs " << core;
  EXPECT_NE(std::getenv("OPENBLAS_NUM_THREADS"), nullptr);  // ours or the operator's
}

TEST(CpuBlas, PrefersTheWidestFamilyTheCpuHas) {
  const std::string preferred = PreferredBlasCore();
  __builtin_cpu_init();
  if (IsaAvailable(Isa::kAvx2) && __builtin_cpu_is("amd")) {
    EXPECT_EQ(preferred, "Zen");  // also with AVX-512 (Zen 4): measured the faster there
  } else if (IsaAvailable(Isa::kAvx512) && __builtin_cpu_supports("avx512cd")) {
    EXPECT_EQ(preferred, "SkylakeX");
  } else if (IsaAvailable(Isa::kAvx2)) {
    EXPECT_EQ(preferred, "Haswell");
  } else {
    EXPECT_EQ(preferred, "");
  }
}

TEST(CpuBlas, SgemmNTMultipliesByTheTranspose) {
  // a [2, 3] @ b[4, 3]^T into a c with a wider row (ldc 5).
  const float a[] = {1, 2, 3, 4, 5, 6};
  const float b[] = {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1};
  float c[10];
  for (float& x : c) x = -7;
  SgemmNT(2, 4, 3, a, 3, b, 3, c, 5);
  const float want[] = {1, 2, 3, 6, -7, 4, 5, 6, 15, -7};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(c[i], want[i]) << i;
}

}  // namespace
}  // namespace tgis::kernels::cpu

// OpenBLAS is loaded with the kernel family this CPU runs (kernels/cpu/blas.h), or the one the
// operator chose with OPENBLAS_CORETYPE; ctest runs this file twice, once with
// OPENBLAS_CORETYPE=Haswell in the environment.
#include <gtest/gtest.h>
#include <strings.h>

#include <cstdlib>
#include <fstream>
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
  const bool avx512 = IsaAvailable(Isa::kAvx512) && __builtin_cpu_supports("avx512cd");
  if (IsaAvailable(Isa::kAvx2) && __builtin_cpu_is("amd")) {
    // Zen also with Zen 4's AVX-512 (256-bit units: measured the faster there); SkylakeX from
    // Zen 5 (family 0x1A) on, whose units are 512 bits wide.
    EXPECT_EQ(preferred, avx512 && CpuFamily() >= 0x1A ? "SkylakeX" : "Zen");
  } else if (avx512) {
    EXPECT_EQ(preferred, "SkylakeX");
  } else if (IsaAvailable(Isa::kAvx2)) {
    EXPECT_EQ(preferred, "Haswell");
  } else {
    EXPECT_EQ(preferred, "");
  }
}

// The kernel choice above depends on the family: the kernel's own report (/proc/cpuinfo's
// "cpu family", computed the same way from cpuid) is the oracle.
TEST(CpuBlas, CpuFamilyIsWhatTheKernelReports) {
  std::ifstream info("/proc/cpuinfo");
  if (!info) GTEST_SKIP() << "no /proc/cpuinfo";
  std::string line;
  while (std::getline(info, line)) {
    if (line.rfind("cpu family", 0) != 0) continue;
    EXPECT_EQ(CpuFamily(), std::stoi(line.substr(line.find(':') + 1))) << line;
    return;
  }
  GTEST_SKIP() << "/proc/cpuinfo has no cpu family line";
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

#include "kernels/cpu/blas.h"

#include <cblas.h>
#include <cpuid.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "kernels/check.h"
#include "kernels/cpu/linear_stream.h"

namespace tgis::kernels::cpu {

namespace {

// The SONAME Debian's libopenblas0 provides (through update-alternatives), then the
// development symlink.
constexpr const char* kLibraries[] = {"libopenblas.so.0", "libopenblas.so"};

struct Blas {
  decltype(&cblas_sgemm) sgemm = nullptr;
  std::string core;
};

template <typename F>
F Symbol(void* lib, const char* name, const char* file) {
  void* p = dlsym(lib, name);
  TGIS_CHECK(p != nullptr, "%s has no symbol %s: is it OpenBLAS?", file, name);
  return reinterpret_cast<F>(p);
}

const Blas& Load() {
  static Blas blas;
  static std::once_flag once;
  std::call_once(once, [] {
    // Both variables are read once, by the library's constructor, so they are set before
    // dlopen; an operator's own values win (overwrite = 0).
    const std::string preferred = PreferredBlasCore();
    if (!preferred.empty()) setenv("OPENBLAS_CORETYPE", preferred.c_str(), 0);
    // Our pool is the parallelism: OpenBLAS's pthread build would otherwise start one
    // thread per core in every shard and never use them.
    setenv("OPENBLAS_NUM_THREADS", "1", 0);
    void* lib = nullptr;
    const char* file = nullptr;
    std::string errors;
    for (const char* name : kLibraries) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) {
        file = name;
        break;
      }
      errors += std::string(" ") + dlerror() + ";";
    }
    TGIS_CHECK(lib != nullptr,
               "cannot load OpenBLAS (%s or %s):%s install libopenblas0 (make deps does)",
               kLibraries[0], kLibraries[1], errors.c_str());
    blas.sgemm = Symbol<decltype(&cblas_sgemm)>(lib, "cblas_sgemm", file);
    auto set_threads = Symbol<void (*)(int)>(lib, "openblas_set_num_threads", file);
    auto corename = Symbol<char* (*)()>(lib, "openblas_get_corename", file);
    set_threads(1);  // also when the operator set OPENBLAS_NUM_THREADS
    const char* core = corename();
    blas.core = core != nullptr ? core : "unknown";
  });
  return blas;
}

}  // namespace

int CpuFamily() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
  const int base = static_cast<int>((eax >> 8) & 0xF);
  return base == 0xF ? base + static_cast<int>((eax >> 20) & 0xFF) : base;
}

std::string PreferredBlasCore() {
  __builtin_cpu_init();
  const bool avx512 = CpuHasAvx512() && __builtin_cpu_supports("avx512cd");
  // AMD first. Zen 4 (family 0x19) runs AVX-512 on 256-bit units, and there OpenBLAS's AVX2
  // "Zen" sgemm is the faster (measured on an EPYC Zen 4, kernels_bench --t=512 f32: 206
  // GFLOP/s against SkylakeX's 195 and Cooperlake's 191). Zen 5 (0x1A) has 512-bit units:
  // SkylakeX's sgemm is 1.8x Zen's there (EPYC Zen 5, the same command: 209-236 against
  // 118-126).
  if (CpuHasAvx2() && __builtin_cpu_is("amd"))
    return avx512 && CpuFamily() >= 0x1A ? "SkylakeX" : "Zen";
  if (avx512) return "SkylakeX";
  if (CpuHasAvx2()) return "Haswell";
  return "";
}

void SgemmNT(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
             int ldc) {
  Load().sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c,
               ldc);
}

std::string BlasCoreName() { return Load().core; }

}  // namespace tgis::kernels::cpu

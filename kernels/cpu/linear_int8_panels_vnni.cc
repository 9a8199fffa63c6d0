// The int8 panels' kernels (linear_int8_panels.cc) compiled for AVX-512 VNNI: 4-bit sums through
// vpdpbusd on ymm registers, the same integers as vpmaddubsw's.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

#define TGIS_PANELS_TARGET TGIS_VNNI
#define TGIS_PANELS_VNNI 1
#include "kernels/cpu/linear_int8_panels_body.h"  // NOLINT(build/include): in this namespace

}  // namespace

void Int8PanelsLinearVnni(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs,
                          const CodePanels& p) {
  RunPanels(a, x, xs, p);
}

}  // namespace tgis::kernels::cpu

// Linear over f32 weights whose rows are short (see linear_short_rows.cc).
#pragma once

#include <cstdint>

namespace tgis::kernels::cpu {

// The longest rows that take this path.
constexpr int64_t kShortRowsMax = 64;

struct ShortRowsArgs {
  const float* x;  // [t, k]
  int64_t t, k;
  const float* w;  // [n, k]
  int64_t n;
  const float* bias;  // [n] or null
  float* out;         // [t, n]
};

bool ShortRowsTake(int64_t k);
void ShortRowsLinear(const ShortRowsArgs& a);

}  // namespace tgis::kernels::cpu

// Quantized weights whose 4-bit codes index a table of 16 values, scaled per block of input
// columns (bitsandbytes' nf4 and fp4, MXFP4), built from a checkpoint's codes read in place.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/quantized.h"
#include "kernels/tensor.h"
#include "server/quantization.h"

namespace tgis::server {

// The weight of `slice` (its rows, its columns) of an [out, in] weight whose code at (n, k) is
// code_at(n, k) and whose blocks of `block` columns have `absmax` ([out, in / block]).
template <typename CodeAt>
kernels::Tensor BlockCodesWeight(const LinearSlice& slice, int64_t in, int64_t block,
                                 const std::vector<float>& absmax, const std::vector<float>& table,
                                 CodeAt code_at) {
  const Range c = slice.cols;
  const int64_t groups = in / block;
  const int64_t nsel = static_cast<int64_t>(slice.rows.size()), kc = c.size();
  std::vector<uint8_t> codes(nsel * kc);
  std::vector<float> scales(nsel * groups);
  for (int64_t i = 0; i < nsel; ++i) {
    const int64_t n = slice.rows[i];
    for (int64_t k = 0; k < kc; ++k) codes[i * kc + k] = code_at(n, c.begin + k);
    std::memcpy(&scales[i * groups], &absmax[n * groups], groups * sizeof(float));
  }
  std::vector<int32_t> group(kc);
  for (int64_t k = 0; k < kc; ++k) group[k] = static_cast<int32_t>((c.begin + k) / block);
  return kernels::Tensor::Quantized(std::make_shared<const kernels::QuantizedWeight>(
      kernels::BuildCodebook4(nsel, kc, codes, group, groups, scales, table)));
}

}  // namespace tgis::server

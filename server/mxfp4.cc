// MXFP4 experts (server/quantization.h): the OCP microscaling format the gpt-oss checkpoints
// store their mixtures of experts in, read as 4-bit codes of the E2M1 table, one power-of-two
// scale per block of 32 input columns.
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/block_codes.h"
#include "server/quantization.h"
#include "server/weights.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

namespace {

constexpr int64_t kBlock = 32;  // input columns a scale covers

// E2M1: the sign in bit 3, then two exponent bits and one mantissa bit.
const std::vector<float>& E2m1Table() {
  static const std::vector<float> table = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return table;
}

// 2^(e - 127) for every E8M0 byte e, exactly (f32 holds 2^-127 as a subnormal; 255 gives
// infinity, as transformers' bf16 ldexp overflows too).
const std::array<float, 256>& E8m0Factors() {
  static const std::array<float, 256> factors = [] {
    std::array<float, 256> f{};
    for (int e = 0; e < 256; ++e) f[e] = std::ldexp(1.0f, e - 127);
    return f;
  }();
  return factors;
}

}  // namespace

absl::StatusOr<Tensor> LoadMxfp4Expert(const WeightStore& w, const std::string& name,
                                       int64_t expert, int64_t experts,
                                       const std::vector<Range>& rows,
                                       std::optional<ColumnSlice> cols) {
  const std::string blocks_name = name + "_blocks", scales_name = name + "_scales";
  auto blocks = w.View(blocks_name);
  if (!blocks.ok()) return blocks.status();
  auto scales = w.View(scales_name);
  if (!scales.ok()) return scales.status();
  const Tensor& b = *blocks;
  const Tensor& sc = *scales;
  if (b.dtype() != DType::kU8 || b.rank() != 4 || b.dim(0) != experts || b.dim(3) != kBlock / 2 ||
      sc.dtype() != DType::kU8 || sc.shape() != kernels::Shape{b.dim(0), b.dim(1), b.dim(2)}) {
    auto describe = [](const Tensor& t) {
      return absl::StrCat(kernels::DTypeName(t.dtype()), " [", absl::StrJoin(t.shape(), ", "), "]");
    };
    return absl::InvalidArgumentError(
        absl::StrCat(blocks_name, " (", describe(b), ") and ", scales_name, " (", describe(sc),
                     "): expected uint8 [", experts, ", out, in / 32, 16] and [", experts,
                     ", out, in / 32] (MXFP4, ", w.FileOf(blocks_name), ")"));
  }
  const int64_t out = b.dim(1), groups = b.dim(2), in = groups * kBlock;
  auto slice = SliceOfLinear(name, w.FileOf(blocks_name), out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  // Each block's factor, 2^(scale - 127), from a table of the 256 (gpt-oss-120b's experts have
  // ~3.6e9 blocks: a libm call each would add up at load).
  const uint8_t* exps = sc.data<uint8_t>() + expert * out * groups;
  std::vector<float> factors(out * groups);
  for (int64_t i = 0; i < out * groups; ++i) factors[i] = E8m0Factors()[exps[i]];
  // Two codes a byte, the element of even index in the low nibble.
  const uint8_t* codes = b.data<uint8_t>() + expert * out * groups * (kBlock / 2);
  const int64_t row_bytes = groups * (kBlock / 2);
  return BlockCodesWeight(*slice, in, kBlock, factors, E2m1Table(),
                          [&](int64_t n, int64_t k) -> uint8_t {
                            const uint8_t byte = codes[n * row_bytes + k / 2];
                            return k % 2 == 0 ? byte & 0xF : byte >> 4;
                          });
}

}  // namespace tgis::server

// Quantized checkpoints and load-time quantization: which method a model folder uses (its
// quantization config, or the --quantize flag), and its linear weights read into the stored
// layout of kernels/quantized.h.
//
//  - GPTQ (AutoGPTQ / GPTQModel): per linear `qweight` [in * bits / 32, out] int32 packed
//    along the input dimension, `qzeros` [groups, out * bits / 32] packed along the output one
//    (stored as zero - 1 unless checkpoint_format is gptq_v2), `scales` [groups, out], `g_idx`
//    [in] (each input column's group; act-order permutes it). 4 and 8 bits; GPTQModel's
//    `dynamic` rules may give a module other bits and group size, or leave it dense.
//  - AWQ (AutoAWQ GEMM): `qweight` [in, out / 8] and `qzeros` [groups, out / 8] packed along
//    the output dimension in the order 0 2 4 6 1 3 5 7, `scales` [groups, out]. 4 bits.
//  - fp8 (llm-compressor's compressed-tensors "float-quantized", FBGEMM's fbgemm_fp8,
//    transformers' own "fp8" of DeepSeek-V3 and Qwen3 FP8 checkpoints): the linear's `weight`
//    [out, in] float8 e4m3fn and `weight_scale` (one, one per output row, or one per block of
//    [rows, columns] weights: [ceil(out / rows), ceil(in / columns)]; transformers' fp8 names
//    it `weight_scale_inv`, a factor all the same), w = fp8 * scale. Weight-only here:
//    activations stay in the compute dtype, so the static `input_scale` / `input_scale_ub`
//    tensors that fp8 GEMMs use are read and unused.
//  - compressed-tensors integers (llm-compressor's W4A16 / W8A16 "pack-quantized", W8A8
//    "int-quantized", "naive-quantized"): signed codes q, w = (q - zero_point) * scale per
//    tensor, output row or group of input columns; packed (`weight_packed` int32 [out,
//    in * bits / 32], code k at bit k * bits, stored as q + 2^(bits - 1); asymmetric zero
//    points packed so along the output dimension) or one int8 per weight (`weight`). Int8
//    activation schemes (W8A8) run weight-only here too, as fp8 ones do.
//  - bitsandbytes (TGIS's --quantize value): a dense checkpoint quantized at load, int8 per
//    output row with absmax scales (kernels::QuantizeInt8Rows). Unlike bitsandbytes'
//    LLM.int8 the activations stay f32 (no int8 activations, so no outlier decomposition is
//    needed): more exact than LLM.int8, never less.
//  - bitsandbytes 8-bit checkpoints (transformers' save_pretrained of a load_in_8bit model):
//    per linear `weight` int8 [out, in], `SCB` f32 [out] (the rows' absmax: w = weight * SCB
//    / 127, bitsandbytes multiplying by 1/127 as an f32), `weight_format` u8 (0: row-major,
//    the only layout bitsandbytes writes). Run as the load-time int8 above, activations f32.
//  - MXFP4 (OCP microscaling; the gpt-oss checkpoints' mixture-of-experts weights, the only
//    modules transformers' Mxfp4 quantizer converts): per expert tensor `X` of [E, out, in],
//    `X_blocks` u8 [E, out, in / 32, 16] (two E2M1 codes a byte, the element of even index in
//    the low nibble) and `X_scales` u8 [E, out, in / 32] (E8M0: a block's factor is
//    2^(scale - 127)). Served as they are: 4-bit codes of the E2M1 table, the kernels' table
//    path (bitsandbytes' fp4 and nf4 take it too), w = E2M1[code] * 2^(scale - 127) as
//    transformers' dequantize computes it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "server/model.h"
#include "server/model_config.h"
#include "server/quant_dynamic.h"

namespace tgis::server {

class WeightStore;

enum class QuantMethod {
  kNone,
  kGptq,
  kAwq,
  kFp8,
  kCompressedInt,
  kInt8AtLoad,
  kBnbInt8,
  kBnb4,        // bitsandbytes' nf4 and fp4 checkpoints
  kBnb4AtLoad,  // --quantize bitsandbytes-nf4 / -fp4 (TGI's): dense weights to 4 bits at load
  kMxfp4,       // the gpt-oss checkpoints' experts (4-bit codes of the E2M1 table)
};

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  int bits = 0;                 // kCompressedInt: 0 where its config groups differ
  int64_t group_size = -1;      // -1: one group per output row (per channel); kCompressedInt:
                                // 0 where its config groups differ (each linear's scales say)
  bool zero_minus_one = false;  // GPTQ v1 stores zero - 1
  // fp8: the scales' tensor (".weight_scale", transformers' fp8 ".weight_scale_inv") and, for
  // scales per block of [block_rows, block_cols] weights, the block (0: per tensor or row).
  std::string fp8_scale = ".weight_scale";
  int64_t block_rows = 0, block_cols = 0;
  // GPTQ's lm_head key (whether the head is quantized, which its tensors must agree with);
  // unset for methods whose configs do not say (their tensors do).
  std::optional<bool> lm_head_quantized;
  // GPTQ and AWQ: GPTQModel's per-module exceptions (quant_dynamic.h), in the file's order.
  std::vector<DynamicRule> dynamic;
  std::string bnb4_type;     // kBnb4AtLoad: nf4 or fp4
  std::string source;        // the file the config came from, for errors
  std::string quant_method;  // the config's ("gptq", "compressed-tensors", ...), if any
};

// TGIS's --quantize values (gptq, bitsandbytes), TGI's bitsandbytes-nf4 and -fp4, and ours
// (awq, fp8, compressed-tensors).
const std::vector<std::string>& QuantizeFlagValues();

// The folder's quantization: config.json's `quantization_config` or AutoGPTQ's
// quantize_config.json, checked against `flag` (--quantize; unset: what the checkpoint says).
// Unknown methods, keys and values are errors naming the file and the key.
absl::StatusOr<QuantConfig> ReadQuantConfig(const std::string& model_dir, const ModelConfig& c,
                                            const std::optional<std::string>& flag);

// Input columns a row-parallel rank loads: `range` of the `whole` the config says the
// weight's input has (the checkpoint's must be that: a wider one would load its first columns).
struct ColumnSlice {
  Range range;
  int64_t whole = 0;
};

// What a loader reads of a linear [out, in]: the output rows `rows` asks for (none: all, in
// order) and the input columns `cols` (unset: all), or an error naming `prefix` and `source`.
struct LinearSlice {
  std::vector<int64_t> rows;
  Range cols;
};
absl::StatusOr<LinearSlice> SliceOfLinear(const std::string& prefix, const std::string& source,
                                          int64_t out, int64_t in, const std::vector<Range>& rows,
                                          std::optional<ColumnSlice> cols);

// The quantized linear `prefix` (its qweight, qzeros, scales, g_idx), rows `rows` of its
// output dimension (concatenated in order; none: all) and columns `cols` of its input
// dimension (unset: all), as a
// quantized Tensor. Errors name the tensor.
absl::StatusOr<kernels::Tensor> LoadQuantizedLinear(const WeightStore& w, const QuantConfig& q,
                                                    const std::string& prefix,
                                                    const std::vector<Range>& rows,
                                                    std::optional<ColumnSlice> cols);

// The compressed-tensors integer linear `prefix` (weight_packed or an int8 weight, its scales
// and zero points, weight_g_idx where present), rows and columns as above.
absl::StatusOr<kernels::Tensor> LoadCompressedIntLinear(const WeightStore& w, const QuantConfig& q,
                                                        const std::string& prefix,
                                                        const std::vector<Range>& rows,
                                                        std::optional<ColumnSlice> cols);

// The bitsandbytes 8-bit linear `prefix` (its int8 weight, SCB and weight_format), rows and
// columns as above.
absl::StatusOr<kernels::Tensor> LoadBnbInt8Linear(const WeightStore& w, const QuantConfig& q,
                                                  const std::string& prefix,
                                                  const std::vector<Range>& rows,
                                                  std::optional<ColumnSlice> cols);

// The bitsandbytes 4-bit linear `prefix` (its packed weight, absmax, quant_map, the nested
// absmax of double quantization and the quant_state.bitsandbytes__nf4 or __fp4 record), rows
// and columns as above.
absl::StatusOr<kernels::Tensor> LoadBnb4Linear(const WeightStore& w, const QuantConfig& q,
                                               const std::string& prefix,
                                               const std::vector<Range>& rows,
                                               std::optional<ColumnSlice> cols);
// bitsandbytes' quantize_4bit (`type` nf4 or fp4, blocks of kBnb4AtLoadBlock along each row,
// the blocks' absmax kept in f32: no double quantization) of a dense [out, in] weight, columns
// `cols` of it kept (a tensor-parallel slice quantized as the whole rows are); errors name
// `name`.
inline constexpr int64_t kBnb4AtLoadBlock = 64;  // bitsandbytes' quantize_4bit default
absl::StatusOr<kernels::Tensor> QuantizeBnb4AtLoad(const kernels::Tensor& dense,
                                                   const std::string& type, Range cols,
                                                   const std::string& name);
// The name of the quant_state record that marks `prefix` as a bitsandbytes 4-bit linear, if
// the store has one.
std::optional<std::string> Bnb4QuantStateOf(const WeightStore& w, const std::string& prefix);

// Expert `expert` (of `experts`) of the MXFP4 weight `name` (its name_blocks and name_scales,
// [out, in] per expert), rows and columns as above.
absl::StatusOr<kernels::Tensor> LoadMxfp4Expert(const WeightStore& w, const std::string& name,
                                                int64_t expert, int64_t experts,
                                                const std::vector<Range>& rows,
                                                std::optional<ColumnSlice> cols);

// The fp8 linear `prefix` (its weight and weight_scale), rows and columns as above.
absl::StatusOr<kernels::Tensor> LoadFp8Linear(const WeightStore& w, const QuantConfig& q,
                                              const std::string& prefix,
                                              const std::vector<Range>& rows,
                                              std::optional<ColumnSlice> cols);

}  // namespace tgis::server

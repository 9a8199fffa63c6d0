// Load-time reshaping of checkpoint tensors into the layouts DecoderWeights expects.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/model_config.h"
#include "server/weights.h"

namespace tgis::server {

// Loads `name` as f32 ([in, out] Conv1D weights become [out, in] when `transpose`).
absl::StatusOr<kernels::Tensor> LoadF32(const WeightStore& w, const std::string& name,
                                        bool transpose = false);
// Stacks 2-D tensors (same column count) or 1-D tensors along dim 0.
kernels::Tensor ConcatRows(const std::vector<kernels::Tensor>& parts);
// Rows laid out per head as [q(D) k(D) v(D)] x H (GPT-NeoX, BigCode MHA) -> q rows, k rows,
// v rows. Works on [3HD, C] weights and [3HD] biases.
kernels::Tensor DeinterleaveQkv(const kernels::Tensor& t, int64_t heads, int64_t head_dim);
// Converts linear weights to the run dtype (norms and biases stay f32).
kernels::Tensor ToRunDType(const kernels::Tensor& t, kernels::DType dtype);
// "gelu" -> erf; "gelu_new", "gelu_pytorch_tanh", "gelu_fast" -> tanh.
absl::StatusOr<kernels::GeluKind> GeluFromName(const std::string& act);

}  // namespace tgis::server

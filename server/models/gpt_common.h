// The GPT-2 family layout (LayerNorm with biases, learned positions, plain GELU MLP), shared by
// GPT-2 and GPT-BigCode, which differ in weight layout (Conv1D vs Linear) and attention heads.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/weights.h"

namespace tgis::server {

struct GptStyleOptions {
  std::string prefix;         // "transformer." or "" (old checkpoints)
  bool conv1d = false;        // weights stored [in, out]
  int64_t num_kv_heads = 0;   // 1 for multi-query attention
  // Turns the checkpoint's fused c_attn (already [out, in], f32) into q|k|v rows.
  std::function<kernels::Tensor(const kernels::Tensor&)> reorder_qkv;
};

absl::StatusOr<std::unique_ptr<CausalLM>> BuildGptStyle(const ModelConfig& config,
                                                        const WeightStore& weights,
                                                        kernels::DType dtype,
                                                        const GptStyleOptions& options);

}  // namespace tgis::server

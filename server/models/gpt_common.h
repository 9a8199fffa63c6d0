// The GPT-2 family layout (LayerNorm with biases, learned positions, plain GELU MLP), shared by
// GPT-2 and GPT-BigCode, which differ in weight layout (Conv1D vs Linear) and attention heads.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/models/weight_utils.h"
#include "server/weights.h"

namespace tgis::server {

struct GptStyleOptions {
  std::string prefix;                         // "transformer." or "" (old checkpoints)
  bool conv1d = false;                        // weights stored [in, out]
  int64_t num_kv_heads = 0;                   // 1 for multi-query attention
  QkvLayout qkv_layout = QkvLayout::kConcat;  // how c_attn fuses q, k and v
};

absl::StatusOr<std::unique_ptr<CausalLM>> BuildGptStyle(const ModelConfig& config,
                                                        const WeightStore& weights,
                                                        kernels::DType dtype,
                                                        std::shared_ptr<Communicator> comm,
                                                        const GptStyleOptions& options);

}  // namespace tgis::server

// The Llama layout (RMSNorm, rotary, gated SiLU MLP, separate q/k/v/o projections), shared by
// the Llama/Mistral and Qwen2 files, which differ in biases and sliding-window settings.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/weights.h"

namespace tgis::server {

struct LlamaStyleOptions {
  bool qkv_bias = false;  // q/k/v_proj biases (Qwen2; Llama's attention_bias)
  bool o_bias = false;    // o_proj bias (Llama's attention_bias)
  bool mlp_bias = false;  // gate/up/down_proj biases (Llama's mlp_bias)
  int sliding_window = 0;
};

absl::StatusOr<std::unique_ptr<CausalLM>> BuildLlamaStyle(const ModelConfig& config,
                                                          const WeightStore& weights,
                                                          kernels::DType dtype,
                                                          std::shared_ptr<Communicator> comm,
                                                          const LlamaStyleOptions& options);

}  // namespace tgis::server

// Microsoft Phi-3 and Phi-3.5 (transformers' Phi3ForCausalLM): the Llama layout with q, k and v
// fused into one qkv_proj and gate and up into one gate_up_proj, a sliding window when the
// config sets one (transformers masks keys more than sliding_window - 1 positions back, as for
// Mistral), LongRoPE as rope_scaling, and partial_rotary_factor (Phi-4-mini's 0.75).
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->fused_projections = true;
  if (auto st = ReadSlidingWindow(c, opt); !st.ok()) return st;
  if (auto st = ReadPartialRotary(c, 1.0, opt); !st.ok()) return st;
  return absl::OkStatus();
}

}  // namespace

void RegisterPhi3Model(ModelRegistry* r) { RegisterLlamaStyle(r, "phi3", ReadOptions); }

}  // namespace tgis::server

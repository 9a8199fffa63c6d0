// AI2's OLMo 2 (transformers' Olmo2ForCausalLM: OLMo-2 1B, 7B, 13B and 32B): the Llama layout
// with
// - the norms on the sublayers' outputs, not their inputs: x += post_attention_layernorm(attn(x));
//   x += post_feedforward_layernorm(mlp(x)) (Residual::kOutputNorms; no input_layernorm);
// - q_norm and k_norm: an RMSNorm over the whole q projection ([heads * head_dim]) and one over
//   the whole k projection, before the split into heads and rotary (DecoderSpec::qk_norms_whole:
//   with tensor parallelism each rank gathers every rank's q and k for them);
// - q/k/v/o biases with attention_bias; rms_norm_eps 1e-5 when absent (Olmo2Config's default).
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  opt->output_norms = true;
  opt->qk_norms = true;
  opt->qk_norms_whole = true;
  opt->rms_norm_eps_default = 1e-5;
  return absl::OkStatus();
}

}  // namespace

void RegisterOlmo2Model(ModelRegistry* r) { RegisterLlamaStyle(r, "olmo2", ReadOptions); }

}  // namespace tgis::server

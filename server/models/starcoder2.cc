// BigCode StarCoder2 (transformers' Starcoder2ForCausalLM): q/k/v/o projections with GQA and
// rotary as in Llama, but LayerNorms with biases (norm_epsilon), a plain MLP (c_fc, hidden_act,
// c_proj), biases on every linear when use_bias (the default), a sliding window when set, and
// tied embeddings.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  auto bias = c.Get<bool>("use_bias", true);
  if (!bias.ok()) return bias.status();
  opt->qkv_bias = opt->o_bias = opt->mlp_bias = *bias;
  opt->layer_norm = true;
  opt->plain_mlp = true;
  opt->default_act = "gelu_pytorch_tanh";
  if (auto st = ReadSlidingWindow(c, opt); !st.ok()) return st;
  return absl::OkStatus();
}

}  // namespace

void RegisterStarcoder2Model(ModelRegistry* r) { RegisterLlamaStyle(r, "starcoder2", ReadOptions); }

}  // namespace tgis::server

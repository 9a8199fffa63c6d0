// Microsoft Phi-1, Phi-1.5 and Phi-2 (transformers' PhiForCausalLM): one LayerNorm a layer
// (weights and biases, layer_norm_eps) feeding attention and the MLP, added to the residual
// together (Residual::kParallel); biases on q/k/v, on the output projection (`dense`), on the
// plain MLP (fc1, hidden_act gelu_new, fc2) and on the lm_head; rotary on the first
// partial_rotary_factor (0.5) of each head; a final LayerNorm named final_layernorm.
// qk_layernorm (per-head q and k LayerNorms, which no released Phi checkpoint sets) is refused;
// resid_pdrop, embd_pdrop and attention_dropout are training's.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = RefuseQkNorms(c, "qk_layernorm", ""); !st.ok()) return st;
  opt->layer_norm = true;
  opt->layer_norm_eps_key = "layer_norm_eps";
  opt->parallel_residual = true;
  opt->plain_mlp = true;
  opt->plain_mlp_in = "fc1";
  opt->plain_mlp_out = "fc2";
  opt->o_proj_name = "dense";
  opt->final_norm_name = "model.final_layernorm";
  opt->qkv_bias = opt->o_bias = opt->mlp_bias = opt->lm_head_bias = true;
  opt->default_act = "gelu_new";
  if (auto st = ReadPartialRotary(c, 0.5, opt); !st.ok()) return st;  // PhiConfig's default
  return absl::OkStatus();
}

}  // namespace

void RegisterPhiModel(ModelRegistry* r) { RegisterLlamaStyle(r, "phi", ReadOptions); }

}  // namespace tgis::server

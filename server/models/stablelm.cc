// Stability AI's StableLM (transformers' StableLmForCausalLM: StableLM-3B-4E1T, StableLM 2,
// Stable Code): the Llama layout with LayerNorms (weights and biases, layer_norm_eps), rotary on
// the first partial_rotary_factor (0.25) of each head, q/k/v biases with use_qkv_bias, and with
// use_parallel_residual one norm a layer feeding attention and the MLP, added together (then
// there is no post_attention_layernorm). qk_layernorm (StableLM 2 12B's per-head q and k
// LayerNorms) is refused.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->layer_norm = true;
  opt->layer_norm_eps_key = "layer_norm_eps";
  if (auto st = RefuseQkNorms(c, "qk_layernorm", "StableLM 2 12B"); !st.ok()) return st;
  auto qkv_bias = c.Get<bool>("use_qkv_bias", false);
  auto parallel = c.Get<bool>("use_parallel_residual", false);
  for (const auto* v : {&qkv_bias, &parallel}) {
    if (!v->ok()) return v->status();
  }
  opt->qkv_bias = *qkv_bias;
  opt->parallel_residual = *parallel;
  // StableLmConfig's default
  if (auto st = ReadPartialRotary(c, 0.25, opt); !st.ok()) return st;
  return absl::OkStatus();
}

}  // namespace

void RegisterStableLmModel(ModelRegistry* r) { RegisterLlamaStyle(r, "stablelm", ReadOptions); }

}  // namespace tgis::server

// Cohere's Command R (transformers' CohereForCausalLM; Command R 35B, Aya): the Llama layout
// with one LayerNorm a layer (no bias, layer_norm_eps) whose output feeds attention and the MLP,
// both added to the residual at once; rotary on interleaved pairs (GPT-J's, where Llama rotates
// halves); logits times logit_scale; tied embeddings. use_qk_norm (Command R+'s per-head q and k
// LayerNorms) is refused.

#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  opt->layer_norm = true;
  opt->norm_bias = false;
  opt->layer_norm_eps_key = "layer_norm_eps";
  opt->parallel_residual = true;
  opt->interleaved_rotary = true;
  if (auto st = RefuseQkNorms(c, "use_qk_norm", "Command R+"); !st.ok()) return st;
  auto scale = ReadMultiplier(c, "logit_scale", 0.0625);  // CohereConfig's default
  if (!scale.ok()) return scale.status();
  opt->logits_scale = *scale;
  return absl::OkStatus();
}

}  // namespace

void RegisterCohereModel(ModelRegistry* r) { RegisterLlamaStyle(r, "cohere", ReadOptions); }

}  // namespace tgis::server

// IBM Granite (transformers' GraniteForCausalLM, Granite 3.x): the Llama layout with four
// multipliers: token embeddings times embedding_multiplier, attention scores times
// attention_multiplier (in place of 1/sqrt(head_dim)), each attention and MLP output times
// residual_multiplier before its residual add, and logits divided by logits_scaling.
// GraniteMoE (granitemoe: Granite 3.x's 1B-A400M and 3B-A800M) is the same with a mixture of
// experts in place of the MLP: a router (router.layer) scores num_local_experts experts, a
// token's num_experts_per_tok best ones run (input_linear [E, 2I, H] holding gate | up,
// output_linear [E, H, I]), weighted by a softmax over their scores. Read only in training,
// so not here: output_router_logits and router_aux_loss_coef.

#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  // GraniteMoE's config has attention_bias but no mlp_bias.
  if (auto st = ReadBiasKeys(c, /*mlp=*/opt->moe == MoeLayout::kNone, opt); !st.ok()) return st;
  auto embed = ReadMultiplier(c, "embedding_multiplier");
  auto residual = ReadMultiplier(c, "residual_multiplier");
  auto attention = ReadMultiplier(c, "attention_multiplier");
  auto logits = ReadMultiplier(c, "logits_scaling");
  for (const auto* m : {&embed, &residual, &attention, &logits}) {
    if (!m->ok()) return m->status();
  }
  opt->embed_scale = *embed;
  opt->residual_scale = *residual;
  opt->attn_scale = *attention;
  // transformers divides the logits; one multiplication by the reciprocal is within an f32
  // rounding of that.
  opt->logits_scale = 1.0f / *logits;
  return absl::OkStatus();
}

}  // namespace

void RegisterGraniteModel(ModelRegistry* r) {
  RegisterLlamaStyleWithExperts(r, "granite", "granitemoe", MoeLayout::kGraniteMoe, ReadOptions);
}

}  // namespace tgis::server

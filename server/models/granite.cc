// IBM Granite (transformers' GraniteForCausalLM, Granite 3.x): the Llama layout with four
// multipliers: token embeddings times embedding_multiplier, attention scores times
// attention_multiplier (in place of 1/sqrt(head_dim)), each attention and MLP output times
// residual_multiplier before its residual add, and logits divided by logits_scaling.
// GraniteMoE (granitemoe: Granite 3.x's 1B-A400M and 3B-A800M) is the same with a mixture of
// experts in place of the MLP: a router (router.layer) scores num_local_experts experts, a
// token's num_experts_per_tok best ones run (input_linear [E, 2I, H] holding gate | up,
// output_linear [E, H, I]), weighted by a softmax over their scores. Read only in training,
// so not here: output_router_logits and router_aux_loss_coef.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

// A multiplier from config.json: transformers' default when absent; finite and non-zero.
absl::StatusOr<float> Multiplier(const ModelConfig& c, const char* key) {
  auto v = c.Get<double>(key, 1.0);
  if (!v.ok()) return v.status();
  const float f = static_cast<float>(*v);  // as a float: 1e300 is no more finite than inf
  if (!std::isfinite(f) || f == 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: ", key, " = ", *v, ": expected a finite, non-zero number (as a float)"));
  }
  return f;
}

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm, MoeLayout moe) {
  LlamaStyleOptions opt;
  opt.moe = moe;
  // GraniteMoE's config has attention_bias but no mlp_bias.
  if (auto st = ReadBiasKeys(c, /*mlp=*/moe == MoeLayout::kNone, &opt); !st.ok()) return st;
  auto embed = Multiplier(c, "embedding_multiplier");
  auto residual = Multiplier(c, "residual_multiplier");
  auto attention = Multiplier(c, "attention_multiplier");
  auto logits = Multiplier(c, "logits_scaling");
  for (const auto* m : {&embed, &residual, &attention, &logits}) {
    if (!m->ok()) return m->status();
  }
  opt.embed_scale = *embed;
  opt.residual_scale = *residual;
  opt.attn_scale = *attention;
  // transformers divides the logits; one multiplication by the reciprocal is within an f32
  // rounding of that.
  opt.logits_scale = 1.0f / *logits;
  return BuildLlamaStyle(c, w, dtype, std::move(comm), opt);
}

}  // namespace

void RegisterGraniteModel(ModelRegistry* r) {
  for (const auto& entry :
       {std::pair{"granite", MoeLayout::kNone}, std::pair{"granitemoe", MoeLayout::kGraniteMoe}}) {
    const MoeLayout moe = entry.second;
    r->Register(entry.first, [moe](const ModelConfig& c, const WeightStore& w, kernels::DType dtype,
                                   std::shared_ptr<Communicator> comm) {
      return Build(c, w, dtype, std::move(comm), moe);
    });
  }
}

}  // namespace tgis::server

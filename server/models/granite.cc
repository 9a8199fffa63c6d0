// IBM Granite (transformers' GraniteForCausalLM, Granite 3.x): the Llama layout with four
// multipliers: token embeddings times embedding_multiplier, attention scores times
// attention_multiplier (in place of 1/sqrt(head_dim)), each attention and MLP output times
// residual_multiplier before its residual add, and logits divided by logits_scaling.
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
                                                std::shared_ptr<Communicator> comm) {
  LlamaStyleOptions opt;
  if (auto st = ReadBiasKeys(c, /*mlp=*/true, &opt); !st.ok()) return st;
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

void RegisterGraniteModel(ModelRegistry* r) { r->Register("granite", Build); }

}  // namespace tgis::server

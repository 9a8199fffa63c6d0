// AI2's OLMo (transformers' OlmoForCausalLM: OLMo-1B-hf, OLMo-7B-hf, OLMo-1.7): the Llama
// layout with LayerNorms that have no weights or biases (eps 1e-5, no config key), q/k/v/o
// biases with attention_bias, and q, k and v clamped to [-clip_qkv, clip_qkv] after their
// projections when clip_qkv is set (null: not).
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  opt->layer_norm = true;
  opt->norm_weights = false;
  opt->fixed_norm_eps = 1e-5;
  auto clip = c.Get<double>("clip_qkv", 0.0);
  if (!clip.ok()) return clip.status();
  if (*clip < 0 || !std::isfinite(static_cast<float>(*clip))) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: clip_qkv = ", *clip, ": expected null or a positive number"));
  }
  opt->clip_qkv = static_cast<float>(*clip);
  return absl::OkStatus();
}

}  // namespace

void RegisterOlmoModel(ModelRegistry* r) { RegisterLlamaStyle(r, "olmo", ReadOptions); }

}  // namespace tgis::server

// OpenAI's GPT-OSS (transformers' GptOssForCausalLM: gpt-oss-20b and gpt-oss-120b): the Llama
// layout with q/k/v/o biases (transformers sets attention_bias true whatever config.json says),
// YaRN rotary (rope_scaling), every other layer attending to the last sliding_window keys
// (layer_types; absent: the even layers, as GptOssConfig derives them), a learned attention
// sink per head (self_attn.sinks: one more logit in each softmax's denominator), and a mixture
// of experts in every MLP: a router with a bias scores num_local_experts experts, a token's
// num_experts_per_tok best run, weighted by a softmax over their scores; each expert's gate|up
// and down projections have biases, and its activation is the clamped SwiGLU
// (up.clamp(-limit, limit) + 1) * gate * sigmoid(1.702 gate), gate clamped above at limit
// (swiglu_limit, 7). The released checkpoints store the experts MXFP4 (quantization_config
// quant_method "mxfp4"), served as 4-bit codes (server/quantization.h).
// Not read: hidden_act (GptOss's experts hard-code their activation, as here),
// initial_context_length and experts_per_token (informational copies of rope_scaling's
// original_max_position_embeddings and of num_experts_per_tok, which transformers reads;
// a differing experts_per_token is warned about), and, read only in training,
// output_router_logits and router_aux_loss_coef.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

// GptOssExperts' alpha (a constant of the class, not of the config).
constexpr float kGluAlpha = 1.702f;

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->qkv_bias = opt->o_bias = true;
  opt->attention_sinks = true;
  opt->rms_norm_eps_default = 1e-5;
  auto window = ReadWindowSize(c, 128);
  if (!window.ok()) return window.status();
  auto windows = ReadLayerTypesOrEvenLayers(c, *window);
  if (!windows.ok()) return windows.status();
  opt->layer_windows = *std::move(windows);
  auto limit = c.Get<double>("swiglu_limit", 7.0);
  if (!limit.ok()) return limit.status();
  if (!(*limit > 0) || !std::isfinite(static_cast<float>(*limit))) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: swiglu_limit = ", *limit,
                                                   ": expected a positive, finite number"));
  }
  opt->glu_limit = static_cast<float>(*limit);
  opt->glu_alpha = kGluAlpha;
  auto per_token = c.Get<int64_t>("num_experts_per_tok", int64_t{4});
  if (!per_token.ok()) return per_token.status();
  auto copy = c.Get<int64_t>("experts_per_token", *per_token);
  if (!copy.ok()) return copy.status();
  if (*copy != *per_token) {
    LOG(WARNING) << "config.json: experts_per_token " << *copy << " differs from "
                 << "num_experts_per_tok " << *per_token
                 << "; each token takes num_experts_per_tok experts, as in transformers";
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterGptOssModel(ModelRegistry* r) {
  RegisterLlamaStyle(r, "gpt_oss", [](const ModelConfig& c, LlamaStyleOptions* opt) {
    opt->moe = MoeLayout::kGptOss;
    return ReadOptions(c, opt);
  });
}

}  // namespace tgis::server

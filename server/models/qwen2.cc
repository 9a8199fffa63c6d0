// Qwen2: the Llama layout with q/k/v biases; a sliding window only with use_sliding_window.
// Qwen2-MoE (qwen2_moe: Qwen1.5-MoE, Qwen2-57B-A14B): the same with a mixture of experts in
// every layer's MLP, num_experts_per_tok of num_experts weighted by their softmax probabilities
// (renormalized with norm_topk_prob), plus a shared expert that every token runs, weighted by
// sigmoid(shared_expert_gate . x). Read only in training, so not here: output_router_logits
// and router_aux_loss_coef.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->qkv_bias = true;
  auto use_window = c.Get<bool>("use_sliding_window", false);
  if (!use_window.ok()) return use_window.status();
  if (*use_window) {
    auto window = c.Get<int64_t>("sliding_window", int64_t{0});
    if (!window.ok()) return window.status();
    // Layers from max_window_layers on use the window (transformers' rule).
    auto first = c.Get<int64_t>("max_window_layers", c.num_layers);
    if (!first.ok()) return first.status();
    if (*first <= 0) {
      opt->sliding_window = static_cast<int>(*window);
    } else if (*first < c.num_layers) {
      return absl::UnimplementedError(
          "config.json: a sliding window on only some layers (max_window_layers) is not "
          "supported");
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Early Qwen2 conversions hold each layer's rotary inv_freq buffer; we compute the frequencies.
void RegisterQwen2Model(ModelRegistry* r) {
  RegisterLlamaStyleWithExperts(r, "qwen2", "qwen2_moe", MoeLayout::kQwen2Moe, ReadOptions,
                                {"model.layers.*.self_attn.rotary_emb.inv_freq"});
}

}  // namespace tgis::server

// Qwen3 (transformers' Qwen3ForCausalLM: Qwen3-0.6B to Qwen3-32B): Qwen2's layout without its
// q/k/v biases (attention_bias gives q, k, v and o biases; false in the released checkpoints),
// plus self_attn.q_norm and k_norm: an RMSNorm (rms_norm_eps) over each q head's and each k
// head's head_dim values, one weight for all q heads and one for all k heads, before rotary.
// head_dim defaults to 128 (Qwen3Config's), not hidden / heads. Sliding windows as transformers
// derives them: a layer whose layer_types entry is "sliding_attention" attends to the last
// sliding_window keys when use_sliding_window is true (else sliding_window is null for every
// layer); without layer_types, the layers from max_window_layers (28) on are those.
// Qwen3-MoE (qwen3_moe: Qwen3-30B-A3B, Qwen3-235B-A22B): the same attention with a mixture of
// experts in every layer's MLP (Qwen2-MoE's names: mlp.gate, mlp.experts.{e}.*_proj; no shared
// expert), num_experts_per_tok of num_experts weighted by their softmax probabilities
// (renormalized with norm_topk_prob). Its window, with use_sliding_window, is on every layer:
// transformers 4.55's Qwen3MoeConfig has no layer_types or max_window_layers (the released
// configs carry max_window_layers; it is not read). Read only in training, so not here:
// output_router_logits, router_aux_loss_coef.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

// Each layer's window (0: every key), or the config key that is wrong; `every_layer`:
// Qwen3-MoE's rule.
absl::StatusOr<std::vector<int>> LayerWindows(const ModelConfig& c, bool every_layer) {
  auto use_window = c.Get<bool>("use_sliding_window", false);
  if (!use_window.ok()) return use_window.status();
  int window = 0;
  if (*use_window && !c.raw.value("sliding_window", nlohmann::json(4096)).is_null()) {
    auto w = ReadWindowSize(c, 4096);
    if (!w.ok()) return w.status();
    window = *w;
  }
  if (every_layer) return std::vector<int>(c.num_layers, window);
  auto windows = ReadLayerTypes(c, window);
  if (!windows.ok() || !windows->empty()) return windows;
  windows->assign(c.num_layers, 0);
  auto first = c.Get<int64_t>("max_window_layers", int64_t{28});
  if (!first.ok()) return first.status();
  for (int64_t l = std::max<int64_t>(0, *first); l < c.num_layers; ++l) (*windows)[l] = window;
  return windows;
}

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  opt->qk_norms = true;
  opt->head_dim_default = 128;
  auto windows = LayerWindows(c, /*every_layer=*/opt->moe != MoeLayout::kNone);
  if (!windows.ok()) return windows.status();
  opt->layer_windows = *std::move(windows);
  return absl::OkStatus();
}

}  // namespace

void RegisterQwen3Model(ModelRegistry* r) {
  RegisterLlamaStyleWithExperts(r, "qwen3", "qwen3_moe", MoeLayout::kQwen3Moe, ReadOptions);
}

}  // namespace tgis::server

// Qwen3 (transformers' Qwen3ForCausalLM: Qwen3-0.6B to Qwen3-32B): Qwen2's layout without its
// q/k/v biases (attention_bias gives q, k, v and o biases; false in the released checkpoints),
// plus self_attn.q_norm and k_norm: an RMSNorm (rms_norm_eps) over each q head's and each k
// head's head_dim values, one weight for all q heads and one for all k heads, before rotary.
// head_dim defaults to 128 (Qwen3Config's), not hidden / heads. Sliding windows as transformers
// derives them: a layer whose layer_types entry is "sliding_attention" attends to the last
// sliding_window keys when use_sliding_window is true (else sliding_window is null for every
// layer); without layer_types, the layers from max_window_layers (28) on are those.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

// Each layer's window (0: every key), or the config key that is wrong.
absl::StatusOr<std::vector<int>> LayerWindows(const ModelConfig& c) {
  auto use_window = c.Get<bool>("use_sliding_window", false);
  if (!use_window.ok()) return use_window.status();
  int window = 0;
  if (*use_window && !c.raw.value("sliding_window", nlohmann::json(4096)).is_null()) {
    auto w = c.Get<int64_t>("sliding_window", int64_t{4096});
    if (!w.ok()) return w.status();
    if (*w <= 0 || *w > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: sliding_window = ", *w, ": expected a positive number"));
    }
    window = static_cast<int>(*w);
  }
  std::vector<int> windows(c.num_layers, 0);
  auto types = c.raw.find("layer_types");
  if (types != c.raw.end() && !types->is_null()) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: layer_types: expected a list of ", c.num_layers, " layer types"));
    }
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const nlohmann::json& t = (*types)[l];
      if (t == "sliding_attention") {
        windows[l] = window;
      } else if (t != "full_attention") {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: layer_types[", l, "] = ", t.dump(),
                         ": expected \"full_attention\" or \"sliding_attention\""));
      }
    }
    return windows;
  }
  auto first = c.Get<int64_t>("max_window_layers", int64_t{28});
  if (!first.ok()) return first.status();
  for (int64_t l = std::max<int64_t>(0, *first); l < c.num_layers; ++l) windows[l] = window;
  return windows;
}

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  LlamaStyleOptions opt;
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, &opt); !st.ok()) return st;
  opt.qk_norms = true;
  opt.head_dim_default = 128;
  auto windows = LayerWindows(c);
  if (!windows.ok()) return windows.status();
  opt.layer_windows = *std::move(windows);
  return BuildLlamaStyle(c, w, dtype, std::move(comm), opt);
}

}  // namespace

void RegisterQwen3Model(ModelRegistry* r) { r->Register("qwen3", Build); }

}  // namespace tgis::server

// Google Gemma 3, text only (transformers' Gemma3ForCausalLM, model_type gemma3_text: Gemma 3
// 1B, and the language model of the larger ones as Gemma3ForCausalLM saves it): Gemma 2's
// layer (Gemma's (1 + w) RMSNorms, sqrt(hidden) embedding scale rounded to the activations'
// dtype, four norms a layer, query_pre_attn_scalar, the MLP's hidden_activation, tied
// embeddings), plus
// - q_norm and k_norm: a (1 + w) RMSNorm over each q head's and each k head's head_dim values,
//   one weight for all q heads and one for all k heads, before rotary (Qwen3's, with Gemma's
//   norm);
// - windows by layer type: "sliding_attention" layers attend to the last sliding_window keys
//   (4096 when absent; null is refused, as transformers refuses to build that mask), the
//   others to every key. layer_types when config.json has it, else every sliding_window_pattern
//   (6) th layer is a full one, as Gemma3TextConfig derives them;
// - two rotary bases: the windowed layers rotate with rope_local_base_freq (10000) unscaled,
//   the full ones with rope_theta (1e6) and rope_scaling (the 4B-27B models' linear factor 8);
//   max_position_embeddings (131072) is the context after that scaling, served as is;
// - final_logit_softcapping (null by default) as Gemma 2's. attn_logit_softcapping is kept in
//   the config but transformers 4.55's Gemma 3 attention never applies it, nor does its
//   Gemma3ForConditionalGeneration the final cap: a non-null value there is refused rather than
//   applied or dropped.
// Absent keys take Gemma3TextConfig's defaults. _sliding_window_pattern is what transformers
// 4.55 saves of sliding_window_pattern beside layer_types, and does not read back (its
// __init__ takes sliding_window_pattern only): not read. cache_implementation ("hybrid") is how
// transformers' generate() stores the cache; the paged cache serves it.
// The multimodal checkpoints (model_type gemma3, Gemma3ForConditionalGeneration: Gemma 3 4B,
// 12B and 27B) are served as their language model, text in and text out
// (LanguageModelSource): text_config over Gemma3TextConfig's defaults, the language model's
// tensors under either release's names (language_model.model.* as 4.50 saved the released
// checkpoints, model.language_model.* as 4.52 and later save them). Not read, as they serve
// images only: the SigLIP vision tower and the projector (vision_config, mm_tokens_per_image,
// their tensors), and the image token ids (image_token_index, boi_token_index,
// eoi_token_index): in text, those tokens are embedded as any other, as transformers does
// without pixel values.
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

// Each layer's window: layer_types, else Gemma3TextConfig's sliding_window_pattern rule.
absl::StatusOr<std::vector<int>> LayerWindows(const ModelConfig& c) {
  if (c.raw.contains("sliding_window") && c.raw["sliding_window"].is_null()) {
    return absl::InvalidArgumentError(
        "config.json: sliding_window = null: Gemma 3's sliding_attention layers need a window");
  }
  auto window = ReadWindowSize(c, 4096);
  if (!window.ok()) return window.status();
  auto windows = ReadLayerTypes(c, *window);
  if (!windows.ok() || !windows->empty()) return windows;
  auto pattern = c.Get<int64_t>("sliding_window_pattern", int64_t{6});
  if (!pattern.ok()) return pattern.status();
  if (*pattern <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: sliding_window_pattern = ", *pattern, ": expected a positive number"));
  }
  for (int64_t l = 0; l < c.num_layers; ++l) windows->push_back((l + 1) % *pattern ? *window : 0);
  return windows;
}

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  // EmbeddingGemma (transformers >= 4.56) is a gemma3_text checkpoint whose attention sees
  // every token both ways: an encoder of sentence embeddings, not a causal LM.
  auto bidirectional = c.Get<bool>("use_bidirectional_attention", false);
  if (!bidirectional.ok()) return bidirectional.status();
  if (*bidirectional) {
    return absl::UnimplementedError(
        "config.json: use_bidirectional_attention = true: an embedding model (EmbeddingGemma), "
        "not a causal LM");
  }
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  if (auto st = UseGemmaLayout(c, "hidden_activation", opt); !st.ok()) return st;
  opt->sandwich_norms = true;
  opt->qk_norms = true;
  opt->head_dim_default = 256;
  auto attn_cap = ReadSoftCap(c, "attn_logit_softcapping", 0.0);
  if (!attn_cap.ok()) return attn_cap.status();
  if (*attn_cap != 0) {
    return absl::UnimplementedError(absl::StrCat(
        "config.json: attn_logit_softcapping = ", *attn_cap,
        ": transformers' Gemma 3 does not apply it (4.55), so what it should do is unknown"));
  }
  auto final_cap = ReadSoftCap(c, "final_logit_softcapping", 0.0);
  if (!final_cap.ok()) return final_cap.status();
  if (*final_cap != 0 && c.source) {
    return absl::UnimplementedError(
        absl::StrCat("config.json: text_config.final_logit_softcapping = ", *final_cap,
                     ": transformers' Gemma3ForConditionalGeneration does not apply it (4.55; its "
                     "Gemma3ForCausalLM does), so what it should do is unknown"));
  }
  opt->final_logit_softcap = *final_cap;
  if (auto st = ReadQueryPreAttnScalar(c, opt); !st.ok()) return st;
  auto windows = LayerWindows(c);
  if (!windows.ok()) return windows.status();
  opt->layer_windows = *std::move(windows);
  auto local_theta = c.Get<double>("rope_local_base_freq", 10000.0);
  if (!local_theta.ok()) return local_theta.status();
  if (!(*local_theta > 0) || !std::isfinite(*local_theta)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: rope_local_base_freq = ", *local_theta, ": expected a positive number"));
  }
  opt->sliding_rope_theta = *local_theta;
  opt->max_positions_scaled = true;
  return absl::OkStatus();
}

// Gemma3TextConfig's defaults (transformers 4.55) for what the readers take from config.json;
// layer_types is derived from the layer count (LayerWindows), so not here.
nlohmann::json TextDefaults() {
  return {{"model_type", "gemma3_text"},
          {"vocab_size", 262208},
          {"hidden_size", 2304},
          {"intermediate_size", 9216},
          {"num_hidden_layers", 26},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 4},
          {"head_dim", 256},
          {"hidden_activation", "gelu_pytorch_tanh"},
          {"max_position_embeddings", 131072},
          {"rms_norm_eps", 1e-6},
          {"pad_token_id", 0},
          {"eos_token_id", 1},
          {"bos_token_id", 2},
          {"tie_word_embeddings", true},
          {"rope_theta", 1000000.0},
          {"attention_bias", false},
          {"query_pre_attn_scalar", 256},
          {"sliding_window", 4096},
          {"final_logit_softcapping", nullptr},
          {"attn_logit_softcapping", nullptr},
          {"rope_scaling", nullptr},
          {"rope_local_base_freq", 10000.0}};
}

}  // namespace

void RegisterGemma3Model(ModelRegistry* r) {
  RegisterLlamaStyle(r, "gemma3_text", ReadOptions);
  r->RegisterLanguageModelSource(LlavaStyleSource("gemma3", "gemma3_text", TextDefaults()));
}

}  // namespace tgis::server

// Google Gemma 2 (transformers' Gemma2ForCausalLM): Gemma's (1 + w) RMSNorms, sqrt(hidden)
// embedding scale and tied embeddings, plus
// - four norms a layer: the attention's and the MLP's outputs are normed before their residual
//   adds (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input norm is
//   pre_feedforward_layernorm (Residual::kSandwich);
// - soft caps: each scaled attention logit becomes tanh(v / 50) * 50 and each output logit
//   tanh(v / 30) * 30 (attn_logit_softcapping, final_logit_softcapping; null: none);
// - attention scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5;
// - sliding_window (4096) on the layers layer_types marks "sliding_attention" (absent: the even
//   ones), the others attending to every key;
// - the MLP's activation from hidden_activation (hidden_act is read only to warn).
// Absent keys take Gemma2Config's defaults, as transformers gives them. cache_implementation
// ("hybrid") is how transformers' generate() stores the cache; the paged cache serves it.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  if (auto st = UseGemmaLayout(c, "hidden_activation", opt); !st.ok()) return st;
  opt->sandwich_norms = true;
  opt->head_dim_default = 256;
  auto attn_cap = ReadSoftCap(c, "attn_logit_softcapping", 50.0);
  if (!attn_cap.ok()) return attn_cap.status();
  auto final_cap = ReadSoftCap(c, "final_logit_softcapping", 30.0);
  if (!final_cap.ok()) return final_cap.status();
  opt->attn_softcap = *attn_cap;
  opt->final_logit_softcap = *final_cap;
  if (auto st = ReadQueryPreAttnScalar(c, opt); !st.ok()) return st;
  if (c.raw.contains("sliding_window")) {
    if (auto st = ReadSlidingWindow(c, opt); !st.ok()) return st;
  } else {
    opt->sliding_window = 4096;
  }
  // transformers >= 4.53 saves layer_types (its default is the even-layers rule).
  auto windows = ReadLayerTypesOrEvenLayers(c, opt->sliding_window);
  if (!windows.ok()) return windows.status();
  opt->layer_windows = *std::move(windows);
  return absl::OkStatus();
}

}  // namespace

void RegisterGemma2Model(ModelRegistry* r) { RegisterLlamaStyle(r, "gemma2", ReadOptions); }

}  // namespace tgis::server

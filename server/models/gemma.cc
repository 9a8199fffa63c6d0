// Google Gemma (transformers' GemmaForCausalLM; Gemma 1, CodeGemma): the Llama layout with
// RMSNorm weights applied as (1 + w), token embeddings times sqrt(hidden) (that factor rounded
// to the activations' dtype, as transformers rounds it), a GELU-gated MLP (hidden_act,
// gelu_pytorch_tanh by default), an explicit head_dim (256 in the 7B: 16 heads x 256 != 3072) and
// tied embeddings.
//
// config.json's hidden_activation is read only to warn: transformers' GemmaMLP takes hidden_act
// and ignores it, and so do we, where vLLM prefers it; a checkpoint whose two keys disagree
// would run differently there.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadBiasKeys(c, /*mlp=*/false, opt); !st.ok()) return st;
  if (auto st = UseGemmaLayout(c, "hidden_act", opt); !st.ok()) return st;
  return absl::OkStatus();
}

}  // namespace

void RegisterGemmaModel(ModelRegistry* r) { RegisterLlamaStyle(r, "gemma", ReadOptions); }

}  // namespace tgis::server

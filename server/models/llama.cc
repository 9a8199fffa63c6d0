// Llama 1/2/3, Code Llama, TinyLlama, Mistral: the Llama layout; attention_bias (q/k/v/o) and
// mlp_bias (gate/up/down) as the config says; Mistral's sliding_window applies when set.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

void RegisterLlamaModels(ModelRegistry* r) {
  auto read = [](const ModelConfig& c, LlamaStyleOptions* opt) {
    if (auto st = ReadBiasKeys(c, /*mlp=*/true, opt); !st.ok()) return st;
    return ReadSlidingWindow(c, opt);
  };
  // Checkpoints saved by transformers before 4.31 hold each layer's rotary inv_freq buffer; we
  // compute the frequencies from the config (as transformers does since).
  const std::vector<std::string> ignored = {"model.layers.*.self_attn.rotary_emb.inv_freq"};
  RegisterLlamaStyle(r, "llama", read, ignored);
  RegisterLlamaStyle(r, "mistral", read, ignored);
}

}  // namespace tgis::server

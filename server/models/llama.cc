// Llama 1/2/3, Code Llama, TinyLlama, Mistral: the Llama layout; attention_bias (q/k/v/o) and
// mlp_bias (gate/up/down) as the config says; Mistral's sliding_window applies when set.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

void RegisterLlamaModels(ModelRegistry* r) {
  auto build = [](const ModelConfig& c, const WeightStore& w, kernels::DType dtype,
                  std::shared_ptr<Communicator> comm) -> absl::StatusOr<std::unique_ptr<CausalLM>> {
    LlamaStyleOptions opt;
    if (auto st = ReadBiasKeys(c, /*mlp=*/true, &opt); !st.ok()) return st;
    if (auto st = ReadSlidingWindow(c, &opt); !st.ok()) return st;
    return BuildLlamaStyle(c, w, dtype, std::move(comm), opt);
  };
  // Checkpoints saved by transformers before 4.31 hold each layer's rotary inv_freq buffer; we
  // compute the frequencies from the config (as transformers does since).
  const std::vector<std::string> ignored = {"model.layers.*.self_attn.rotary_emb.inv_freq"};
  r->Register("llama", build, ignored);
  r->Register("mistral", build, ignored);
}

}  // namespace tgis::server

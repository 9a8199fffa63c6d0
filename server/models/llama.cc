// Llama 1/2/3, Code Llama, TinyLlama, Mistral: the Llama layout without biases; Mistral's
// sliding_window applies when set.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

void RegisterLlamaModels(ModelRegistry* r) {
  auto build = [](const ModelConfig& c, const WeightStore& w, kernels::DType dtype,
                  std::shared_ptr<Communicator> comm) -> absl::StatusOr<std::unique_ptr<CausalLM>> {
    LlamaStyleOptions opt;
    auto bias = c.Get<bool>("attention_bias", false);
    if (!bias.ok()) return bias.status();
    opt.qkv_bias = *bias;
    auto window = c.Get<int64_t>("sliding_window", int64_t{0});
    if (!window.ok()) return window.status();
    opt.sliding_window = static_cast<int>(*window);
    return BuildLlamaStyle(c, w, dtype, std::move(comm), opt);
  };
  r->Register("llama", build);
  r->Register("mistral", build);
}

}  // namespace tgis::server

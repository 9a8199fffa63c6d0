// GPT-2 (and DialoGPT, DistilGPT2): Conv1D weights stored [in, out], fused c_attn as q|k|v.
#include "server/model_registry.h"
#include "server/models/gpt_common.h"

namespace tgis::server {

void RegisterGpt2Model(ModelRegistry* r) {
  r->Register("gpt2", [](const ModelConfig& c, const WeightStore& w, kernels::DType dtype)
                          -> absl::StatusOr<std::unique_ptr<CausalLM>> {
    GptStyleOptions opt;
    opt.prefix = w.Has("transformer.wte.weight") ? "transformer." : "";
    opt.conv1d = true;
    return BuildGptStyle(c, w, dtype, opt);
  });
}

}  // namespace tgis::server

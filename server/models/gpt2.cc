// GPT-2 (and DialoGPT, DistilGPT2): Conv1D weights stored [in, out], fused c_attn as q|k|v.
#include "server/model_registry.h"
#include "server/models/gpt_common.h"

namespace tgis::server {

namespace {

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  GptStyleOptions opt;
  opt.prefix = w.Has("transformer.wte.weight") ? "transformer." : "";
  opt.conv1d = true;
  return BuildGptStyle(c, w, dtype, std::move(comm), opt);
}

}  // namespace

// The original GPT-2 checkpoints (and transformers before 4.26) store each layer's causal-mask
// buffers attn.bias and attn.masked_bias; attention here is causal by construction.
void RegisterGpt2Model(ModelRegistry* r) {
  r->Register("gpt2", Build,
              {"h.*.attn.bias", "h.*.attn.masked_bias", "transformer.h.*.attn.bias",
               "transformer.h.*.attn.masked_bias"});
}

}  // namespace tgis::server

// Mistral's Mixtral (transformers' MixtralForCausalLM): the Llama layout with a sparse mixture
// of experts in place of the MLP. block_sparse_moe.gate scores num_local_experts experts, each
// a SiLU-gated MLP (w1 gate, w3 up, w2 down), and a token's output is the sum of its
// num_experts_per_tok best experts weighted by their softmax probabilities renormalized to 1.
// sliding_window as Mistral's. Read only in training, so not here: router_jitter_noise,
// router_aux_loss_coef and output_router_logits.
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->moe = MoeLayout::kMixtral;
  if (auto st = ReadSlidingWindow(c, opt); !st.ok()) return st;
  return absl::OkStatus();
}

}  // namespace

void RegisterMixtralModel(ModelRegistry* r) { RegisterLlamaStyle(r, "mixtral", ReadOptions); }

}  // namespace tgis::server

// GPT-BigCode (StarCoder, SantaCoder): GPT-2 layout with nn.Linear weights; multi-query
// attention (one key/value head) when multi_query, else per-head [q k v] fused rows.
#include "server/model_registry.h"
#include "server/models/gpt_common.h"

namespace tgis::server {

namespace {

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  GptStyleOptions opt;
  opt.prefix = "transformer.";
  auto mq = c.Get<bool>("multi_query", true);
  if (!mq.ok()) return mq.status();
  if (*mq) {
    opt.num_kv_heads = 1;  // rows q (H D), k (D), v (D); the one KV head is on every rank
    opt.qkv_layout = QkvLayout::kConcat;
  } else {
    opt.qkv_layout = QkvLayout::kPerHead;
  }
  return BuildGptStyle(c, w, dtype, std::move(comm), opt);
}

}  // namespace

void RegisterGptBigCodeModel(ModelRegistry* r) { r->Register("gpt_bigcode", Build); }

}  // namespace tgis::server

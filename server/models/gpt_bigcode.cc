// GPT-BigCode (StarCoder, SantaCoder): GPT-2 layout with nn.Linear weights; multi-query
// attention (one key/value head) when multi_query, else per-head [q k v] fused rows.
#include "server/model_registry.h"
#include "server/models/gpt_common.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

void RegisterGptBigCodeModel(ModelRegistry* r) {
  r->Register("gpt_bigcode", [](const ModelConfig& c, const WeightStore& w,
                                kernels::DType dtype) -> absl::StatusOr<std::unique_ptr<CausalLM>> {
    GptStyleOptions opt;
    opt.prefix = "transformer.";
    auto mq = c.Get<bool>("multi_query", true);
    if (!mq.ok()) return mq.status();
    if (*mq) {
      opt.num_kv_heads = 1;  // rows already q (H), k (D), v (D)
    } else {
      const int64_t heads = c.num_heads, d = c.hidden_size / c.num_heads;
      opt.reorder_qkv = [heads, d](const kernels::Tensor& t) {
        return DeinterleaveQkv(t, heads, d);
      };
    }
    return BuildGptStyle(c, w, dtype, opt);
  });
}

}  // namespace tgis::server

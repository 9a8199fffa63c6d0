#include "server/models/gpt_common.h"

#include "absl/strings/str_cat.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<std::unique_ptr<CausalLM>> BuildGptStyle(const ModelConfig& c, const WeightStore& w,
                                                        DType dtype,
                                                        std::shared_ptr<Communicator> comm,
                                                        const GptStyleOptions& opt) {
  DecoderSpec s = MultiHeadSpec(c);
  if (opt.num_kv_heads > 0) s.num_kv_heads = opt.num_kv_heads;
  auto inner = c.Get<int64_t>("n_inner", 4 * c.hidden_size);
  if (!inner.ok()) return inner.status();
  s.intermediate = *inner;
  auto eps = c.Get<double>("layer_norm_epsilon", 1e-5);
  if (!eps.ok()) return eps.status();
  s.norm = NormKind::kLayer;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kPlain;
  auto act = c.Get<std::string>("activation_function", std::string("gelu_new"));
  if (!act.ok()) return act.status();
  auto gelu = ActivationFromName(*act, "activation_function");
  if (!gelu.ok()) return gelu.status();
  s.act = *gelu;
  s.position = PositionKind::kLearned;
  auto by_layer = c.Get<bool>("scale_attn_by_inverse_layer_idx", false);
  auto scaled = c.Get<bool>("scale_attn_weights", true);
  if (!by_layer.ok()) return by_layer.status();
  if (!scaled.ok()) return scaled.status();
  if (*by_layer) {
    return absl::UnimplementedError(
        "config.json: scale_attn_by_inverse_layer_idx = true is not supported");
  }
  if (!*scaled) s.attn_scale = 1.0f;

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  const bool conv1d = opt.conv1d;
  const std::string& p = opt.prefix;
  DecoderWeights dw;
  auto wte = ld.VocabRows(p + "wte.weight");
  auto wpe = ld.Whole(p + "wpe.weight");
  if (!wte.ok()) return wte.status();
  if (!wpe.ok()) return wpe.status();
  dw.embed = *wte;
  dw.pos_embed = *wpe;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string l = absl::StrCat(p, "h.", i, ".");
    LayerWeights lw;
    TensorLoads loads;
    loads.emplace_back(&lw.qkv_w, ld.FusedQkv(l + "attn.c_attn.weight", opt.qkv_layout, conv1d));
    loads.emplace_back(&lw.qkv_b, ld.FusedQkv(l + "attn.c_attn.bias", opt.qkv_layout));
    loads.emplace_back(&lw.o_w, ld.InputColumns(l + "attn.c_proj.weight", ld.q_rows(), conv1d));
    loads.emplace_back(&lw.up_w, ld.OutputRows(l + "mlp.c_fc.weight", {ld.mlp_rows()}, conv1d));
    loads.emplace_back(&lw.up_b, ld.OutputRows(l + "mlp.c_fc.bias", {ld.mlp_rows()}));
    loads.emplace_back(&lw.down_w, ld.InputColumns(l + "mlp.c_proj.weight", ld.mlp_rows(), conv1d));
    for (auto [dst, name] :
         {std::pair{&lw.o_b, "attn.c_proj.bias"}, std::pair{&lw.down_b, "mlp.c_proj.bias"},
          std::pair{&lw.ln1_w, "ln_1.weight"}, std::pair{&lw.ln1_b, "ln_1.bias"},
          std::pair{&lw.ln2_w, "ln_2.weight"}, std::pair{&lw.ln2_b, "ln_2.bias"}}) {
      loads.emplace_back(dst, ld.Whole(l + name));
    }
    for (auto& [dst, t] : loads) {
      if (!t.ok()) return t.status();
      *dst = *t;
    }
    dw.layers.push_back(std::move(lw));
  }
  auto lnf_w = ld.Whole(p + "ln_f.weight");
  auto lnf_b = ld.Whole(p + "ln_f.bias");
  if (!lnf_w.ok()) return lnf_w.status();
  if (!lnf_b.ok()) return lnf_b.status();
  dw.final_norm_w = *lnf_w;
  dw.final_norm_b = *lnf_b;
  return FinishDecoder(ld, w, "lm_head.weight", c.raw.value("tie_word_embeddings", true),
                       std::move(s), std::move(dw), std::move(comm));
}

}  // namespace tgis::server

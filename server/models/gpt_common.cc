#include "server/models/gpt_common.h"

#include "absl/strings/str_cat.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<std::unique_ptr<CausalLM>> BuildGptStyle(const ModelConfig& c,
                                                        const WeightStore& w, DType dtype,
                                                        const GptStyleOptions& opt) {
  DecoderSpec s;
  s.hidden = c.hidden_size;
  s.num_layers = c.num_layers;
  s.num_heads = c.num_heads;
  s.num_kv_heads = opt.num_kv_heads > 0 ? opt.num_kv_heads : c.num_heads;
  s.head_dim = c.hidden_size / c.num_heads;
  s.vocab = c.vocab_size;
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
  auto gelu = GeluFromName(*act);
  if (!gelu.ok()) return gelu.status();
  s.gelu = *gelu;
  s.position = PositionKind::kLearned;
  if (c.raw.value("scale_attn_by_inverse_layer_idx", false)) {
    return absl::UnimplementedError("config.json: scale_attn_by_inverse_layer_idx is not supported");
  }
  if (!c.raw.value("scale_attn_weights", true)) s.attn_scale = 1.0f;

  const std::string& p = opt.prefix;
  auto linear = [&](const std::string& name) -> absl::StatusOr<Tensor> {
    auto t = LoadF32(w, name, opt.conv1d);
    if (!t.ok()) return t.status();
    return ToRunDType(*t, dtype);
  };
  DecoderWeights dw;
  auto wte = w.Get(p + "wte.weight", dtype);
  auto wpe = w.Get(p + "wpe.weight", DType::kF32);
  if (!wte.ok()) return wte.status();
  if (!wpe.ok()) return wpe.status();
  dw.embed = *wte;
  dw.pos_embed = *wpe;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string l = absl::StrCat(p, "h.", i, ".");
    LayerWeights lw;
    auto qkv = LoadF32(w, l + "attn.c_attn.weight", opt.conv1d);
    auto qkv_b = LoadF32(w, l + "attn.c_attn.bias");
    if (!qkv.ok()) return qkv.status();
    if (!qkv_b.ok()) return qkv_b.status();
    lw.qkv_w = ToRunDType(opt.reorder_qkv ? opt.reorder_qkv(*qkv) : *qkv, dtype);
    lw.qkv_b = opt.reorder_qkv ? opt.reorder_qkv(*qkv_b) : *qkv_b;
    for (auto [dst, name] : {std::pair{&lw.o_w, "attn.c_proj.weight"},
                             std::pair{&lw.up_w, "mlp.c_fc.weight"},
                             std::pair{&lw.down_w, "mlp.c_proj.weight"}}) {
      auto t = linear(l + name);
      if (!t.ok()) return t.status();
      *dst = *t;
    }
    for (auto [dst, name] :
         {std::pair{&lw.o_b, "attn.c_proj.bias"}, std::pair{&lw.up_b, "mlp.c_fc.bias"},
          std::pair{&lw.down_b, "mlp.c_proj.bias"}, std::pair{&lw.ln1_w, "ln_1.weight"},
          std::pair{&lw.ln1_b, "ln_1.bias"}, std::pair{&lw.ln2_w, "ln_2.weight"},
          std::pair{&lw.ln2_b, "ln_2.bias"}}) {
      auto t = LoadF32(w, l + name);
      if (!t.ok()) return t.status();
      *dst = *t;
    }
    dw.layers.push_back(std::move(lw));
  }
  auto lnf_w = LoadF32(w, p + "ln_f.weight");
  auto lnf_b = LoadF32(w, p + "ln_f.bias");
  if (!lnf_w.ok()) return lnf_w.status();
  if (!lnf_b.ok()) return lnf_b.status();
  dw.final_norm_w = *lnf_w;
  dw.final_norm_b = *lnf_b;
  if (w.Has("lm_head.weight") && !c.raw.value("tie_word_embeddings", true)) {
    auto head = w.Get("lm_head.weight", dtype);
    if (!head.ok()) return head.status();
    dw.lm_head = *head;
  } else {
    dw.lm_head = dw.embed;
  }
  if (auto st = ValidateWeights(s, dw); !st.ok()) return st;
  return std::make_unique<CausalLM>(std::move(s), std::move(dw));
}

}  // namespace tgis::server

// GPT-NeoX (Pythia, GPT-NeoX-20B, MPT-style NeoX tokenizers aside): LayerNorm, partial NeoX
// rotary (rotary_pct), per-head interleaved fused qkv, parallel residual by default.
#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"
#include "server/rope_config.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

namespace {

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                DType dtype, std::shared_ptr<Communicator> comm) {
  DecoderSpec s = MultiHeadSpec(c);
  auto inter = c.Get<int64_t>("intermediate_size");
  if (!inter.ok()) return inter.status();
  s.intermediate = *inter;
  auto eps = c.Get<double>("layer_norm_eps", 1e-5);
  if (!eps.ok()) return eps.status();
  s.norm = NormKind::kLayer;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kPlain;
  auto act = c.Get<std::string>("hidden_act", std::string("gelu"));
  if (!act.ok()) return act.status();
  auto gelu = ActivationFromName(*act, "hidden_act");
  if (!gelu.ok()) return gelu.status();
  s.act = *gelu;
  auto parallel = c.Get<bool>("use_parallel_residual", true);
  if (!parallel.ok()) return parallel.status();
  s.residual = *parallel ? Residual::kParallel : Residual::kSequential;
  s.position = PositionKind::kRotary;
  auto pct = c.Get<double>("rotary_pct", 1.0);
  if (!pct.ok()) return pct.status();
  auto theta_or =
      c.Get<double>(c.raw.contains("rope_theta") ? "rope_theta" : "rotary_emb_base", 10000.0);
  if (!theta_or.ok()) return theta_or.status();
  const double theta = *theta_or;
  auto rotary = PartialRotaryDim(s.head_dim, *pct, "rotary_pct");
  if (!rotary.ok()) return rotary.status();
  s.rotary.rotary_dim = *rotary;
  s.rotary.style = kernels::RotaryStyle::kNeox;
  s.rotary.inv_freq = kernels::RotaryInvFreq(s.rotary.rotary_dim, theta);
  if (auto it = c.raw.find("rope_scaling"); it != c.raw.end() && !it->is_null()) {
    return absl::UnimplementedError("config.json: rope_scaling is not supported for gpt_neox");
  }

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  DecoderWeights dw;
  auto embed = ld.VocabRows("gpt_neox.embed_in.weight");
  if (!embed.ok()) return embed.status();
  dw.embed = *embed;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("gpt_neox.layers.", i, ".");
    LayerWeights l;
    TensorLoads loads;
    // query_key_value rows are [q k v] per head.
    loads.emplace_back(&l.qkv_w,
                       ld.FusedQkv(p + "attention.query_key_value.weight", QkvLayout::kPerHead));
    loads.emplace_back(&l.qkv_b,
                       ld.FusedQkv(p + "attention.query_key_value.bias", QkvLayout::kPerHead));
    loads.emplace_back(&l.o_w, ld.InputColumns(p + "attention.dense.weight", ld.q_rows()));
    loads.emplace_back(&l.up_w, ld.OutputRows(p + "mlp.dense_h_to_4h.weight", {ld.mlp_rows()}));
    loads.emplace_back(&l.up_b, ld.OutputRows(p + "mlp.dense_h_to_4h.bias", {ld.mlp_rows()}));
    loads.emplace_back(&l.down_w, ld.InputColumns(p + "mlp.dense_4h_to_h.weight", ld.mlp_rows()));
    for (auto [dst, name] :
         {std::pair{&l.o_b, "attention.dense.bias"}, std::pair{&l.down_b, "mlp.dense_4h_to_h.bias"},
          std::pair{&l.ln1_w, "input_layernorm.weight"},
          std::pair{&l.ln1_b, "input_layernorm.bias"},
          std::pair{&l.ln2_w, "post_attention_layernorm.weight"},
          std::pair{&l.ln2_b, "post_attention_layernorm.bias"}}) {
      loads.emplace_back(dst, ld.Whole(p + name));
    }
    if (auto st = AssignLoads(&loads); !st.ok()) return st;
    dw.layers.push_back(std::move(l));
  }
  auto fw = ld.Whole("gpt_neox.final_layer_norm.weight");
  auto fb = ld.Whole("gpt_neox.final_layer_norm.bias");
  if (!fw.ok()) return fw.status();
  if (!fb.ok()) return fb.status();
  dw.final_norm_w = *fw;
  dw.final_norm_b = *fb;
  return FinishDecoder(ld, w, "embed_out.weight", c.tie_word_embeddings, std::move(s),
                       std::move(dw), std::move(comm));
}

}  // namespace

// Pythia and GPT-NeoX-20B checkpoints store each layer's causal-mask buffers and rotary
// inv_freq; attention is causal by construction and the frequencies come from the config.
void RegisterGptNeoxModel(ModelRegistry* r) {
  r->Register("gpt_neox", Build,
              {"gpt_neox.layers.*.attention.bias", "gpt_neox.layers.*.attention.masked_bias",
               "gpt_neox.layers.*.attention.rotary_emb.inv_freq"});
}

}  // namespace tgis::server

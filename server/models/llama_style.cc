#include "server/models/llama_style.h"

#include "absl/strings/str_cat.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<std::unique_ptr<CausalLM>> BuildLlamaStyle(const ModelConfig& c,
                                                          const WeightStore& w, DType dtype,
                                                          std::shared_ptr<Communicator> comm,
                                                          const LlamaStyleOptions& opt) {
  DecoderSpec s;
  s.hidden = c.hidden_size;
  s.num_layers = c.num_layers;
  s.num_heads = c.num_heads;
  s.num_kv_heads = c.num_kv_heads;
  s.head_dim = c.head_dim;
  s.vocab = c.vocab_size;
  auto inter = c.Get<int64_t>("intermediate_size");
  if (!inter.ok()) return inter.status();
  s.intermediate = *inter;
  auto eps = c.Get<double>("rms_norm_eps", 1e-6);
  if (!eps.ok()) return eps.status();
  s.norm = NormKind::kRms;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kGatedSilu;
  auto act = c.Get<std::string>("hidden_act", std::string("silu"));
  if (!act.ok()) return act.status();
  if (*act != "silu") {
    return absl::UnimplementedError(
        absl::StrCat("config.json: hidden_act '", *act, "' is not supported for ", c.model_type));
  }
  s.position = PositionKind::kRotary;
  auto theta = c.Get<double>("rope_theta", 10000.0);
  if (!theta.ok()) return theta.status();
  double factor = 0, low = 1, high = 4;
  int original = 8192;
  if (auto it = c.raw.find("rope_scaling"); it != c.raw.end() && it->is_object()) {
    std::string type = it->value("rope_type", it->value("type", std::string()));
    if (type == "llama3") {
      factor = it->value("factor", 8.0);
      low = it->value("low_freq_factor", 1.0);
      high = it->value("high_freq_factor", 4.0);
      original = it->value("original_max_position_embeddings", 8192);
    } else if (type != "default") {
      return absl::UnimplementedError(
          absl::StrCat("config.json: rope_scaling type '", type, "' is not supported"));
    }
  }
  s.rotary.rotary_dim = static_cast<int>(s.head_dim);
  s.rotary.style = kernels::RotaryStyle::kNeox;
  s.rotary.inv_freq =
      kernels::RotaryInvFreq(s.rotary.rotary_dim, *theta, factor, low, high, original);
  s.sliding_window = opt.sliding_window;

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  const Range q = ld.q_rows(), kv = ld.kv_rows(), mlp = ld.mlp_rows();
  DecoderWeights dw;
  auto embed = ld.VocabRows("model.embed_tokens.weight");
  if (!embed.ok()) return embed.status();
  dw.embed = *embed;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::string a = p + "self_attn.";
    LayerWeights l;
    auto qkv = ld.StackOutputRows(
        {{a + "q_proj.weight", q}, {a + "k_proj.weight", kv}, {a + "v_proj.weight", kv}});
    if (!qkv.ok()) return qkv.status();
    l.qkv_w = *qkv;
    if (opt.qkv_bias) {
      auto b = ld.StackOutputRows(
          {{a + "q_proj.bias", q}, {a + "k_proj.bias", kv}, {a + "v_proj.bias", kv}});
      if (!b.ok()) return b.status();
      l.qkv_b = *b;
    }
    auto o = ld.InputColumns(a + "o_proj.weight", q);
    if (!o.ok()) return o.status();
    l.o_w = *o;
    auto gate_up =
        ld.StackOutputRows({{p + "mlp.gate_proj.weight", mlp}, {p + "mlp.up_proj.weight", mlp}});
    if (!gate_up.ok()) return gate_up.status();
    l.up_w = *gate_up;
    auto down = ld.InputColumns(p + "mlp.down_proj.weight", mlp);
    if (!down.ok()) return down.status();
    l.down_w = *down;
    auto ln1 = ld.Whole(p + "input_layernorm.weight");
    auto ln2 = ld.Whole(p + "post_attention_layernorm.weight");
    if (!ln1.ok()) return ln1.status();
    if (!ln2.ok()) return ln2.status();
    l.ln1_w = *ln1;
    l.ln2_w = *ln2;
    dw.layers.push_back(std::move(l));
  }
  auto norm = ld.Whole("model.norm.weight");
  if (!norm.ok()) return norm.status();
  dw.final_norm_w = *norm;
  return FinishDecoder(ld, w, "lm_head.weight", c.tie_word_embeddings, std::move(s), std::move(dw),
                       std::move(comm));
}

}  // namespace tgis::server

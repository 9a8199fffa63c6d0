#include "server/models/llama_style.h"

#include "absl/strings/str_cat.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<std::unique_ptr<CausalLM>> BuildLlamaStyle(const ModelConfig& c,
                                                          const WeightStore& w, DType dtype,
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
    return absl::UnimplementedError(absl::StrCat("config.json: hidden_act '", *act, "' is not supported for ", c.model_type));
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
  s.rotary.inv_freq = kernels::RotaryInvFreq(s.rotary.rotary_dim, *theta, factor, low, high, original);
  s.sliding_window = opt.sliding_window;

  DecoderWeights dw;
  auto embed = w.Get("model.embed_tokens.weight", dtype);
  if (!embed.ok()) return embed.status();
  dw.embed = *embed;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerWeights l;
    std::vector<Tensor> qkv, qkv_b, gate_up;
    for (const char* n : {"q_proj", "k_proj", "v_proj"}) {
      auto t = LoadF32(w, p + "self_attn." + n + ".weight");
      if (!t.ok()) return t.status();
      qkv.push_back(*t);
      if (opt.qkv_bias) {
        auto b = LoadF32(w, p + "self_attn." + n + ".bias");
        if (!b.ok()) return b.status();
        qkv_b.push_back(*b);
      }
    }
    l.qkv_w = ToRunDType(ConcatRows(qkv), dtype);
    if (opt.qkv_bias) l.qkv_b = ConcatRows(qkv_b);
    auto o = w.Get(p + "self_attn.o_proj.weight", dtype);
    if (!o.ok()) return o.status();
    l.o_w = *o;
    for (const char* n : {"gate_proj", "up_proj"}) {
      auto t = LoadF32(w, p + "mlp." + n + ".weight");
      if (!t.ok()) return t.status();
      gate_up.push_back(*t);
    }
    l.up_w = ToRunDType(ConcatRows(gate_up), dtype);
    auto down = w.Get(p + "mlp.down_proj.weight", dtype);
    if (!down.ok()) return down.status();
    l.down_w = *down;
    auto ln1 = LoadF32(w, p + "input_layernorm.weight");
    auto ln2 = LoadF32(w, p + "post_attention_layernorm.weight");
    if (!ln1.ok()) return ln1.status();
    if (!ln2.ok()) return ln2.status();
    l.ln1_w = *ln1;
    l.ln2_w = *ln2;
    dw.layers.push_back(std::move(l));
  }
  auto norm = LoadF32(w, "model.norm.weight");
  if (!norm.ok()) return norm.status();
  dw.final_norm_w = *norm;
  if (!c.tie_word_embeddings && w.Has("lm_head.weight")) {
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

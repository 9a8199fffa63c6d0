// MPT (mosaicml/mpt-*): ALiBi with MPT's own slopes, bias-free LayerNorms and linears, fused
// Wqkv as q|k|v, optional clip_qkv, an exact-GELU MLP of expansion_ratio x d_model, tied head.
//
// attn_config keys: alibi (must be true: MPT without ALiBi has learned positions, which
// transformers does not implement either), alibi_bias_max, clip_qkv and softmax_scale are
// read; qk_ln, prefix_lm and non-default attn_type are refused (transformers silently ignores
// qk_ln); attn_impl, attn_pdrop, attn_uses_sequence_id and model_type only concern training or
// kernel choice. logit_scale other than null/1 is refused.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

namespace {

using Json = nlohmann::json;

// build_mpt_alibi_tensor's slopes in f32: 1 / 2^(i * max / p) for i = 1..p (p: the power of
// two >= n), and for n < p the odd-indexed ones first, then the even ones, cut to n.
std::vector<float> MptAlibiSlopes(int n, double bias_max) {
  int p = 1;
  while (p < n) p *= 2;
  const float step = static_cast<float>(bias_max / p);
  std::vector<float> all(p);
  for (int i = 0; i < p; ++i) {
    const float base = static_cast<float>(i + 1) * step;
    all[i] = 1.0f / static_cast<float>(std::pow(2.0, static_cast<double>(base)));
  }
  if (p == n) return all;
  std::vector<float> out;
  for (int i = 1; i < p; i += 2) out.push_back(all[i]);
  for (int i = 0; i < p; i += 2) out.push_back(all[i]);
  out.resize(n);
  return out;
}

absl::Status Refuse(const std::string& key, const Json& value) {
  return absl::UnimplementedError(
      absl::StrCat("config.json: ", key, " = ", value.dump(), " is not supported for mpt"));
}

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  const Json attn = c.raw.value("attn_config", Json::object());
  if (!attn.is_object()) return Refuse("attn_config", attn);
  if (!attn.value("alibi", true)) return Refuse("attn_config.alibi", attn["alibi"]);
  if (attn.value("qk_ln", false)) return Refuse("attn_config.qk_ln", attn["qk_ln"]);
  if (attn.value("prefix_lm", false)) return Refuse("attn_config.prefix_lm", attn["prefix_lm"]);
  if (attn.value("attn_type", std::string("multihead_attention")) != "multihead_attention") {
    return Refuse("attn_config.attn_type", attn["attn_type"]);
  }
  if (auto it = c.raw.find("logit_scale");
      it != c.raw.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 1.0)) {
    return Refuse("logit_scale", *it);
  }
  if (auto it = c.raw.find("norm_type");
      it != c.raw.end() && *it != "low_precision_layernorm" && *it != "layernorm") {
    return Refuse("norm_type", *it);
  }
  DecoderSpec s = MultiHeadSpec(c);
  auto ratio = c.Get<int64_t>("expansion_ratio", int64_t{4});
  if (!ratio.ok()) return ratio.status();
  s.intermediate = *ratio * c.hidden_size;
  auto eps = c.Get<double>("layer_norm_epsilon", 1e-5);
  if (!eps.ok()) return eps.status();
  s.norm = NormKind::kLayer;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kPlain;
  s.act = kernels::Activation::kGeluErf;
  s.position = PositionKind::kAlibi;
  const Json bias_max = attn.value("alibi_bias_max", Json(8));
  if (!bias_max.is_number() || bias_max.get<double>() <= 0) {
    return Refuse("attn_config.alibi_bias_max", bias_max);
  }
  s.alibi_slopes = MptAlibiSlopes(static_cast<int>(s.num_heads), bias_max.get<double>());
  if (auto it = attn.find("clip_qkv"); it != attn.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() <= 0) return Refuse("attn_config.clip_qkv", *it);
    s.clip_qkv = it->get<float>();
  }
  if (auto it = attn.find("softmax_scale"); it != attn.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() <= 0) {
      return Refuse("attn_config.softmax_scale", *it);
    }
    s.attn_scale = it->get<float>();
  }

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  DecoderWeights dw;
  TensorLoads loads;
  loads.emplace_back(&dw.embed, ld.VocabRows("transformer.wte.weight"));
  loads.emplace_back(&dw.final_norm_w, ld.Whole("transformer.norm_f.weight"));
  dw.layers.resize(s.num_layers);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("transformer.blocks.", i, ".");
    LayerWeights& l = dw.layers[i];
    loads.emplace_back(&l.qkv_w, ld.FusedQkv(p + "attn.Wqkv.weight", QkvLayout::kConcat));
    loads.emplace_back(&l.o_w, ld.InputColumns(p + "attn.out_proj.weight", ld.q_rows()));
    loads.emplace_back(&l.up_w, ld.OutputRows(p + "ffn.up_proj.weight", {ld.mlp_rows()}));
    loads.emplace_back(&l.down_w, ld.InputColumns(p + "ffn.down_proj.weight", ld.mlp_rows()));
    loads.emplace_back(&l.ln1_w, ld.Whole(p + "norm_1.weight"));
    loads.emplace_back(&l.ln2_w, ld.Whole(p + "norm_2.weight"));
  }
  if (auto st = AssignLoads(&loads); !st.ok()) return st;
  return FinishDecoder(ld, w, "lm_head.weight", c.raw.value("tie_word_embeddings", true),
                       std::move(s), std::move(dw), std::move(comm));
}

}  // namespace

void RegisterMptModel(ModelRegistry* r) { r->Register("mpt", Build); }

}  // namespace tgis::server

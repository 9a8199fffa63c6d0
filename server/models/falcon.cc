// Falcon: the 7B layout (multi-query, attention and MLP in parallel off one LayerNorm), the
// 40B/180B layout (new_decoder_architecture: grouped KV heads, ln_attn and ln_mlp), and the
// RefinedWeb-1B layout (sequential, biases, ALiBi). Rotary unless `alibi`.
//
// ALiBi: transformers 4.49 adds Falcon's ALiBi bias twice in eager attention (once folded into
// the causal mask, once in the attention); we add it once, as the original RefinedWeb code
// does, scaled by 1/sqrt(head_dim) with the logits (Falcon's own order, unlike BLOOM's).
// transformers also rounds slope x position to bf16; we keep it in f32.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"
#include "server/rope_config.h"

namespace tgis::server {

namespace {

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  // Legacy model types: RefinedWeb is the new architecture, RefinedWebModel the 7B one.
  auto new_arch = c.Get<bool>("new_decoder_architecture", c.model_type == "RefinedWeb");
  auto multi_query = c.Get<bool>("multi_query", true);
  auto parallel_attn = c.Get<bool>("parallel_attn", true);
  auto bias = c.Get<bool>("bias", false);
  auto alibi = c.Get<bool>("alibi", false);
  auto eps = c.Get<double>("layer_norm_epsilon", 1e-5);
  auto act = c.Get<std::string>("activation", std::string("gelu"));
  for (const absl::Status& st : {new_arch.status(), multi_query.status(), parallel_attn.status(),
                                 bias.status(), alibi.status(), eps.status(), act.status()}) {
    if (!st.ok()) return st;
  }
  DecoderSpec s = MultiHeadSpec(c);
  if (*new_arch) {
    auto kv =
        c.Get<int64_t>(c.raw.contains("num_kv_heads") ? "num_kv_heads" : "n_head_kv", int64_t{0});
    if (!kv.ok()) return kv.status();
    s.num_kv_heads = *kv > 0 ? *kv : c.num_heads;
  } else {
    s.num_kv_heads = *multi_query ? 1 : c.num_heads;
  }
  auto ffn = c.Get<int64_t>("ffn_hidden_size", 4 * c.hidden_size);
  if (!ffn.ok()) return ffn.status();
  s.intermediate = *ffn;
  s.norm = NormKind::kLayer;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kPlain;
  auto activation = ActivationFromName(*act, "activation");
  if (!activation.ok()) return activation.status();
  s.act = *activation;
  // The MLP runs beside attention in the new architecture whatever parallel_attn says.
  s.residual = *new_arch || *parallel_attn ? Residual::kParallel : Residual::kSequential;
  // Layer norms: two (ln_attn, ln_mlp) in the new architecture unless num_ln_in_parallel_attn
  // is 1; else input_layernorm, shared by the MLP when parallel.
  int64_t num_ln = 0;
  if (auto it = c.raw.find("num_ln_in_parallel_attn"); it != c.raw.end() && !it->is_null()) {
    if (!it->is_number_integer() || (it->get<int64_t>() != 1 && it->get<int64_t>() != 2)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: num_ln_in_parallel_attn = ", it->dump(), ": expected 1 or 2"));
    }
    num_ln = it->get<int64_t>();
  }
  const bool two_ln = *new_arch && num_ln != 1;
  if (*alibi) {
    s.position = PositionKind::kAlibi;
    s.alibi_slopes = kernels::AlibiSlopes(static_cast<int>(s.num_heads));
    const float inv_norm = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    for (float& slope : s.alibi_slopes) slope *= inv_norm;
  } else {
    auto theta = c.Get<double>("rope_theta", 10000.0);
    if (!theta.ok()) return theta.status();
    s.rotary.style = kernels::RotaryStyle::kNeox;
    if (auto st = ReadRope(c, static_cast<int>(s.head_dim), *theta, &s); !st.ok()) return st;
  }
  const QkvLayout qkv_layout = *new_arch      ? QkvLayout::kGrouped
                               : *multi_query ? QkvLayout::kConcat
                                              : QkvLayout::kPerHead;

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  DecoderWeights dw;
  TensorLoads loads;
  loads.emplace_back(&dw.embed, ld.VocabRows("transformer.word_embeddings.weight"));
  loads.emplace_back(&dw.final_norm_w, ld.Whole("transformer.ln_f.weight"));
  loads.emplace_back(&dw.final_norm_b, ld.Whole("transformer.ln_f.bias"));
  dw.layers.resize(s.num_layers);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i, ".");
    LayerWeights& l = dw.layers[i];
    const std::string qkv = p + "self_attention.query_key_value.";
    loads.emplace_back(&l.qkv_w, ld.FusedQkv(qkv + "weight", qkv_layout));
    loads.emplace_back(&l.o_w, ld.InputColumns(p + "self_attention.dense.weight", ld.q_rows()));
    loads.emplace_back(&l.up_w, ld.OutputRows(p + "mlp.dense_h_to_4h.weight", {ld.mlp_rows()}));
    loads.emplace_back(&l.down_w, ld.InputColumns(p + "mlp.dense_4h_to_h.weight", ld.mlp_rows()));
    if (*bias) {
      loads.emplace_back(&l.qkv_b, ld.FusedQkv(qkv + "bias", qkv_layout));
      loads.emplace_back(&l.o_b, ld.Whole(p + "self_attention.dense.bias"));
      loads.emplace_back(&l.up_b, ld.OutputRows(p + "mlp.dense_h_to_4h.bias", {ld.mlp_rows()}));
      loads.emplace_back(&l.down_b, ld.Whole(p + "mlp.dense_4h_to_h.bias"));
    }
    const std::string ln1 = two_ln ? "ln_attn." : "input_layernorm.";
    const std::string ln2 = two_ln                                ? "ln_mlp."
                            : s.residual == Residual::kSequential ? "post_attention_layernorm."
                                                                  : ln1;  // shared
    loads.emplace_back(&l.ln1_w, ld.Whole(p + ln1 + "weight"));
    loads.emplace_back(&l.ln1_b, ld.Whole(p + ln1 + "bias"));
    loads.emplace_back(&l.ln2_w, ld.Whole(p + ln2 + "weight"));
    loads.emplace_back(&l.ln2_b, ld.Whole(p + ln2 + "bias"));
  }
  if (auto st = AssignLoads(&loads); !st.ok()) return st;
  return FinishDecoder(ld, w, "lm_head.weight", c.raw.value("tie_word_embeddings", true),
                       std::move(s), std::move(dw), std::move(comm));
}

}  // namespace

void RegisterFalconModel(ModelRegistry* r) {
  for (const char* type : {"falcon", "RefinedWeb", "RefinedWebModel"}) r->Register(type, Build);
}

}  // namespace tgis::server

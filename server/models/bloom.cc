// BLOOM (bigscience/bloom*, bloomz): ALiBi, a LayerNorm right after the word embeddings, fused
// query_key_value laid out per head ([q k v] of head 0, then head 1, ...), a tanh-GELU MLP of
// 4 x hidden, tied lm_head.
#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

namespace {

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  DecoderSpec s = MultiHeadSpec(c);
  s.intermediate = 4 * c.hidden_size;
  auto eps = c.Get<double>("layer_norm_epsilon", 1e-5);
  if (!eps.ok()) return eps.status();
  s.norm = NormKind::kLayer;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = MlpKind::kPlain;
  s.act = kernels::Activation::kGeluTanh;  // bloom_gelu_forward
  s.position = PositionKind::kAlibi;       // BLOOM's slopes are kernels::AlibiSlopes
  s.embed_norm = true;
  auto post = c.Get<bool>("apply_residual_connection_post_layernorm", false);
  if (!post.ok()) return post.status();
  if (*post) {
    return absl::UnimplementedError(
        "config.json: apply_residual_connection_post_layernorm = true is not supported");
  }
  // No position limit in BLOOM's config: ModelConfig's max_position_embeddings stays 0 and the
  // router's MAX_SEQUENCE_LENGTH bounds sequences.

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  // Hub checkpoints were saved from BloomModel (no "transformer." prefix); transformers'
  // save_pretrained of BloomForCausalLM adds it.
  const std::string pre = w.Has("transformer.word_embeddings.weight") ? "transformer." : "";
  DecoderWeights dw;
  TensorLoads loads;
  loads.emplace_back(&dw.embed, ld.VocabRows(pre + "word_embeddings.weight"));
  loads.emplace_back(&dw.embed_norm_w, ld.Whole(pre + "word_embeddings_layernorm.weight"));
  loads.emplace_back(&dw.embed_norm_b, ld.Whole(pre + "word_embeddings_layernorm.bias"));
  loads.emplace_back(&dw.final_norm_w, ld.Whole(pre + "ln_f.weight"));
  loads.emplace_back(&dw.final_norm_b, ld.Whole(pre + "ln_f.bias"));
  dw.layers.resize(s.num_layers);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat(pre, "h.", i, ".");
    LayerWeights& l = dw.layers[i];
    const std::string qkv = p + "self_attention.query_key_value.";
    loads.emplace_back(&l.qkv_w, ld.FusedQkv(qkv + "weight", QkvLayout::kPerHead));
    loads.emplace_back(&l.qkv_b, ld.FusedQkv(qkv + "bias", QkvLayout::kPerHead));
    loads.emplace_back(&l.o_w, ld.InputColumns(p + "self_attention.dense.weight", ld.q_rows()));
    loads.emplace_back(&l.o_b, ld.Whole(p + "self_attention.dense.bias"));
    loads.emplace_back(&l.up_w, ld.OutputRows(p + "mlp.dense_h_to_4h.weight", {ld.mlp_rows()}));
    loads.emplace_back(&l.up_b, ld.OutputRows(p + "mlp.dense_h_to_4h.bias", {ld.mlp_rows()}));
    loads.emplace_back(&l.down_w, ld.InputColumns(p + "mlp.dense_4h_to_h.weight", ld.mlp_rows()));
    loads.emplace_back(&l.down_b, ld.Whole(p + "mlp.dense_4h_to_h.bias"));
    loads.emplace_back(&l.ln1_w, ld.Whole(p + "input_layernorm.weight"));
    loads.emplace_back(&l.ln1_b, ld.Whole(p + "input_layernorm.bias"));
    loads.emplace_back(&l.ln2_w, ld.Whole(p + "post_attention_layernorm.weight"));
    loads.emplace_back(&l.ln2_b, ld.Whole(p + "post_attention_layernorm.bias"));
  }
  if (auto st = AssignLoads(&loads); !st.ok()) return st;
  return FinishDecoder(ld, w, "lm_head.weight", c.raw.value("tie_word_embeddings", true),
                       std::move(s), std::move(dw), std::move(comm));
}

}  // namespace

void RegisterBloomModel(ModelRegistry* r) { r->Register("bloom", Build); }

}  // namespace tgis::server

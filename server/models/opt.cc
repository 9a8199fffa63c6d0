// OPT and Galactica: learned positions (stored with an offset of 2), pre-LN layers or, with
// do_layer_norm_before false (OPT-350m), post-LN layers and no final norm; token embeddings of
// word_embed_proj_dim projected in and out when narrower than the model; separate q/k/v/out
// projections and a fc1/fc2 MLP (ReLU for OPT, GELU for Galactica); tied lm_head.
#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

namespace {

// OPTLearnedPositionalEmbedding looks position p up at row p + 2.
constexpr int64_t kPositionOffset = 2;

absl::StatusOr<std::unique_ptr<CausalLM>> Build(const ModelConfig& c, const WeightStore& w,
                                                kernels::DType dtype,
                                                std::shared_ptr<Communicator> comm) {
  auto ffn = c.Get<int64_t>("ffn_dim");
  auto pre_ln = c.Get<bool>("do_layer_norm_before", true);
  auto remove_final = c.Get<bool>("_remove_final_layer_norm", false);
  auto act = c.Get<std::string>("activation_function", std::string("relu"));
  auto bias = c.Get<bool>("enable_bias", true);
  auto affine = c.Get<bool>("layer_norm_elementwise_affine", true);
  auto proj = c.Get<int64_t>("word_embed_proj_dim", c.hidden_size);
  for (const absl::Status& st : {ffn.status(), pre_ln.status(), remove_final.status(), act.status(),
                                 bias.status(), affine.status(), proj.status()}) {
    if (!st.ok()) return st;
  }
  if (!*affine) {
    return absl::UnimplementedError(
        "config.json: layer_norm_elementwise_affine = false is not supported for opt");
  }
  DecoderSpec s = MultiHeadSpec(c);
  s.intermediate = *ffn;
  s.embed_dim = *proj;
  s.norm = NormKind::kLayer;
  s.norm_eps = 1e-5f;  // nn.LayerNorm's default; OPT's config has no epsilon
  s.mlp = MlpKind::kPlain;
  auto activation = ActivationFromName(*act, "activation_function");
  if (!activation.ok()) return activation.status();
  s.act = *activation;
  s.position = PositionKind::kLearned;
  s.residual = *pre_ln ? Residual::kSequential : Residual::kPostNorm;

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  // facebook/opt-* checkpoints were saved from OPTModel ("decoder." names); transformers'
  // save_pretrained of OPTForCausalLM adds "model.".
  const std::string d = w.Has("model.decoder.embed_tokens.weight") ? "model.decoder." : "decoder.";
  DecoderWeights dw;
  TensorLoads loads;
  loads.emplace_back(&dw.embed, ld.VocabRows(d + "embed_tokens.weight"));
  loads.emplace_back(&dw.pos_embed, ld.Whole(d + "embed_positions.weight"));
  if (s.EmbedDim() != s.hidden) {
    // Replicated, in the run dtype (they are linears).
    loads.emplace_back(&dw.project_in, ld.OutputRows(d + "project_in.weight", {{0, s.hidden}}));
    loads.emplace_back(&dw.project_out,
                       ld.OutputRows(d + "project_out.weight", {{0, s.EmbedDim()}}));
  }
  if (*pre_ln && !*remove_final) {
    loads.emplace_back(&dw.final_norm_w, ld.Whole(d + "final_layer_norm.weight"));
    loads.emplace_back(&dw.final_norm_b, ld.Whole(d + "final_layer_norm.bias"));
  }
  dw.layers.resize(s.num_layers);
  const Range q = ld.q_rows(), mlp = ld.mlp_rows();
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat(d, "layers.", i, ".");
    const std::string a = p + "self_attn.";
    LayerWeights& l = dw.layers[i];
    loads.emplace_back(&l.qkv_w, ld.StackOutputRows({{a + "q_proj.weight", q},
                                                     {a + "k_proj.weight", q},
                                                     {a + "v_proj.weight", q}}));
    loads.emplace_back(&l.o_w, ld.InputColumns(a + "out_proj.weight", q));
    loads.emplace_back(&l.up_w, ld.OutputRows(p + "fc1.weight", {mlp}));
    loads.emplace_back(&l.down_w, ld.InputColumns(p + "fc2.weight", mlp));
    if (*bias) {
      loads.emplace_back(
          &l.qkv_b, ld.StackOutputRows(
                        {{a + "q_proj.bias", q}, {a + "k_proj.bias", q}, {a + "v_proj.bias", q}}));
      loads.emplace_back(&l.o_b, ld.Whole(a + "out_proj.bias"));
      loads.emplace_back(&l.up_b, ld.OutputRows(p + "fc1.bias", {mlp}));
      loads.emplace_back(&l.down_b, ld.Whole(p + "fc2.bias"));
    }
    // Pre-LN: the norms before attention and MLP; post-LN: after them (the same tensors).
    loads.emplace_back(&l.ln1_w, ld.Whole(p + "self_attn_layer_norm.weight"));
    loads.emplace_back(&l.ln1_b, ld.Whole(p + "self_attn_layer_norm.bias"));
    loads.emplace_back(&l.ln2_w, ld.Whole(p + "final_layer_norm.weight"));
    loads.emplace_back(&l.ln2_b, ld.Whole(p + "final_layer_norm.bias"));
  }
  if (auto st = AssignLoads(&loads); !st.ok()) return st;
  if (dw.pos_embed.rank() != 2 || dw.pos_embed.dim(0) <= kPositionOffset) {
    return absl::InvalidArgumentError(
        absl::StrCat(d, "embed_positions.weight: expected [positions + 2, hidden]"));
  }
  dw.pos_embed = dw.pos_embed.Rows(kPositionOffset, dw.pos_embed.dim(0));
  return FinishDecoder(ld, w, "lm_head.weight", c.raw.value("tie_word_embeddings", true),
                       std::move(s), std::move(dw), std::move(comm));
}

}  // namespace

void RegisterOptModel(ModelRegistry* r) { r->Register("opt", Build); }

}  // namespace tgis::server

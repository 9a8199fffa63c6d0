#include "server/models/llama_style.h"

#include <cmath>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "server/models/weight_utils.h"
#include "server/rope_config.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

namespace {

// Gemma's RMSNorm weights are offsets from 1: transformers multiplies by (1 + w) in f32, which
// the f32 weight 1 + w gives exactly.
absl::StatusOr<Tensor> NormWeight(const ShardedLoader& ld, const std::string& name, bool plus_one) {
  auto w = ld.Whole(name);
  if (!w.ok() || !plus_one) return w;
  std::vector<float> v(w->data<float>(), w->data<float>() + w->numel());
  for (float& x : v) x += 1.0f;
  return Tensor::FromVector(v, w->shape());
}

// The norm `prefix` ("model.norm"): its weight, and its bias for LayerNorms.
absl::Status LoadNorm(const ShardedLoader& ld, const std::string& prefix,
                      const LlamaStyleOptions& opt, Tensor* w, Tensor* b) {
  if (!opt.norm_weights) {  // OLMo's: nothing in the checkpoint; scaled by 1, no bias
    *w = Tensor::FromVector(std::vector<float>(ld.spec().hidden, 1.0f), {ld.spec().hidden});
    return absl::OkStatus();
  }
  auto weight = NormWeight(ld, prefix + ".weight", opt.norm_plus_one);
  if (!weight.ok()) return weight.status();
  *w = *weight;
  if (!opt.layer_norm || !opt.norm_bias) return absl::OkStatus();
  auto bias = ld.Whole(prefix + ".bias");
  if (!bias.ok()) return bias.status();
  *b = *bias;
  return absl::OkStatus();
}

// This rank's part of layer `p`'s MLP: gate|up and down (Llama: gate_proj, up_proj, down_proj;
// Phi-3: gate_up_proj, down_proj), or StarCoder2's c_fc and c_proj.
absl::Status LoadMlp(const ShardedLoader& ld, const std::string& p, int64_t intermediate,
                     const LlamaStyleOptions& opt, LayerWeights* l) {
  const Range mlp = ld.mlp_rows();
  const std::string m = p + "mlp.";
  TensorLoads loads;
  if (opt.granite_shared_mlp) {
    const std::string g = p + "shared_mlp.";
    loads.emplace_back(&l->up_w,
                       ld.OutputRows(g + "input_linear.weight", {mlp, mlp.Shifted(intermediate)}));
    loads.emplace_back(&l->down_w, ld.InputColumns(g + "output_linear.weight", mlp));
    return AssignLoads(&loads);
  }
  if (opt.plain_mlp) {
    const std::string in = m + opt.plain_mlp_in, out = m + opt.plain_mlp_out;
    loads.emplace_back(&l->up_w, ld.OutputRows(in + ".weight", {mlp}));
    loads.emplace_back(&l->down_w, ld.InputColumns(out + ".weight", mlp));
    if (opt.mlp_bias) {
      loads.emplace_back(&l->up_b, ld.OutputRows(in + ".bias", {mlp}));
      loads.emplace_back(&l->down_b, ld.Whole(out + ".bias"));
    }
    return AssignLoads(&loads);
  }
  loads.emplace_back(
      &l->up_w,
      opt.fused_projections
          ? ld.OutputRows(m + "gate_up_proj.weight", {mlp, mlp.Shifted(intermediate)})
          : ld.StackOutputRows({{m + "gate_proj.weight", mlp}, {m + "up_proj.weight", mlp}}));
  loads.emplace_back(&l->down_w, ld.InputColumns(m + "down_proj.weight", mlp));
  if (opt.mlp_bias) {
    loads.emplace_back(
        &l->up_b, ld.StackOutputRows({{m + "gate_proj.bias", mlp}, {m + "up_proj.bias", mlp}}));
    loads.emplace_back(&l->down_b, ld.Whole(m + "down_proj.bias"));
  }
  return AssignLoads(&loads);
}

// This rank's part of layer `p`'s mixture of experts: the router whole, and each expert's
// gate|up rows and down columns.
absl::Status LoadExperts(const ShardedLoader& ld, const std::string& p, const DecoderSpec& s,
                         MoeLayout layout, LayerWeights* l) {
  const Range mlp = ld.mlp_rows();
  const std::string m = p + "block_sparse_moe.";
  l->expert_up.resize(s.num_experts);
  l->expert_down.resize(s.num_experts);
  TensorLoads loads;
  if (layout == MoeLayout::kMixtral) {
    loads.emplace_back(&l->router_w, ld.Whole(m + "gate.weight"));
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const std::string x = absl::StrCat(m, "experts.", e, ".");
      loads.emplace_back(&l->expert_up[e],
                         ld.StackOutputRows({{x + "w1.weight", mlp}, {x + "w3.weight", mlp}}));
      loads.emplace_back(&l->expert_down[e], ld.InputColumns(x + "w2.weight", mlp));
    }
  } else if (layout == MoeLayout::kQwen2Moe || layout == MoeLayout::kQwen3Moe) {
    const std::string q = p + "mlp.";
    if (layout == MoeLayout::kQwen3Moe) {
      loads.emplace_back(&l->router_w, ld.Whole(q + "gate.weight"));
    } else {
      auto router = ld.Whole(q + "gate.weight");
      auto gate = ld.Whole(q + "shared_expert_gate.weight");
      for (const auto* t : {&router, &gate}) {
        if (!t->ok()) return t->status();
      }
      // The shared expert's gate as the router's last row: one product, one copy to the host.
      loads.emplace_back(&l->router_w, ConcatRows({*router, *gate}, q + "gate.weight"));
    }
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const std::string x = absl::StrCat(q, "experts.", e, ".");
      loads.emplace_back(&l->expert_up[e], ld.StackOutputRows({{x + "gate_proj.weight", mlp},
                                                               {x + "up_proj.weight", mlp}}));
      loads.emplace_back(&l->expert_down[e], ld.InputColumns(x + "down_proj.weight", mlp));
    }
    if (layout == MoeLayout::kQwen3Moe) return AssignLoads(&loads);
    const Range shared = ld.layout().shared_expert;
    const std::string x = q + "shared_expert.";
    loads.emplace_back(&l->shared_up, ld.StackOutputRows({{x + "gate_proj.weight", shared},
                                                          {x + "up_proj.weight", shared}}));
    loads.emplace_back(&l->shared_down, ld.InputColumns(x + "down_proj.weight", shared));
  } else if (layout == MoeLayout::kGptOss) {
    const std::string x = p + "mlp.";
    loads.emplace_back(&l->router_w, ld.Whole(x + "router.weight"));
    loads.emplace_back(&l->router_b, ld.Whole(x + "router.bias"));
    // This rank's gate columns (2j) then up columns (2j + 1), j in its MLP columns: the
    // [gate | up] rows every gated MLP here takes.
    std::vector<Range> gate_up;
    for (int64_t j = mlp.begin; j < mlp.end; ++j) gate_up.push_back({2 * j, 2 * j + 1});
    for (int64_t j = mlp.begin; j < mlp.end; ++j) gate_up.push_back({2 * j + 1, 2 * j + 2});
    l->expert_up_b.resize(s.num_experts);
    l->expert_down_b.resize(s.num_experts);
    const std::string up = x + "experts.gate_up_proj", down = x + "experts.down_proj";
    // Dense checkpoints store the experts [in, out] (as conv1d), MXFP4 ones [out, in].
    const bool up_dense = !ld.StoresMxfp4(up), down_dense = !ld.StoresMxfp4(down);
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const ShardedLoader expert = ld.Expert(e);
      loads.emplace_back(&l->expert_up[e], expert.OutputRows(up, gate_up, up_dense));
      loads.emplace_back(&l->expert_up_b[e], expert.OutputRows(up + "_bias", gate_up));
      loads.emplace_back(&l->expert_down[e], expert.InputColumns(down, mlp, down_dense));
      loads.emplace_back(&l->expert_down_b[e], expert.Whole(down + "_bias"));
    }
  } else {
    loads.emplace_back(&l->router_w, ld.Whole(m + "router.layer.weight"));
    for (int64_t e = 0; e < s.num_experts; ++e) {
      const ShardedLoader expert = ld.Expert(e);
      loads.emplace_back(&l->expert_up[e], expert.OutputRows(m + "input_linear.weight",
                                                             {mlp, mlp.Shifted(s.intermediate)}));
      loads.emplace_back(&l->expert_down[e], expert.InputColumns(m + "output_linear.weight", mlp));
    }
    if (layout == MoeLayout::kGraniteMoeShared && s.shared_expert_intermediate > 0) {
      const Range shared = ld.layout().shared_expert;
      const std::string g = p + "shared_mlp.";
      loads.emplace_back(&l->shared_up,
                         ld.OutputRows(g + "input_linear.weight",
                                       {shared, shared.Shifted(s.shared_expert_intermediate)}));
      loads.emplace_back(&l->shared_down, ld.InputColumns(g + "output_linear.weight", shared));
    }
  }
  return AssignLoads(&loads);
}

// Ranges with the neighbours that touch joined (so a rank holding everything reads one range:
// a view of the mapped file, not a copy).
std::vector<Range> Joined(const std::vector<Range>& ranges) {
  std::vector<Range> out;
  for (const Range& r : ranges) {
    if (!out.empty() && out.back().end == r.begin) {
      out.back().end = r.end;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// Small f32 tensor `name`, whole, that must have `shape`, then rows `ranges` of its first
// dimension ([rows, the rest flattened]; 1-D: [rows]): the whole shape checked before a rank
// takes its part, so a tensor longer than the config says is an error at every world size.
absl::StatusOr<Tensor> RowsOfWhole(const ShardedLoader& ld, const std::string& name,
                                   const kernels::Shape& shape, const std::vector<Range>& ranges) {
  auto whole = ld.WholeShaped(name, shape);
  if (!whole.ok()) return whole.status();
  const Tensor all =
      shape.size() == 1 ? *whole : whole->Reshape({shape[0], whole->numel() / shape[0]});
  std::vector<Tensor> parts;
  for (const Range& r : ranges) parts.push_back(all.Rows(r.begin, r.end));
  return ConcatRows(parts, name);
}

// A Mamba-2 mixer's weights (GraniteMoeHybrid's `mamba.` modules): the two projections in the
// run dtype, the rest in f32, each this rank's heads and groups (ShardLayout). in_proj's rows
// are [z | x | B | C | dt] (heads of head_dim, groups of state_size, one dt a head); the
// convolution's channels [x | B | C]; out_proj's input columns the heads'. The gated norm's
// weight is whole (CausalLM::MambaMixer norms every rank's columns together).
absl::Status LoadMamba(const ShardedLoader& ld, const std::string& m, const MambaSpec& spec,
                       LayerWeights* l) {
  const ShardLayout& layout = ld.layout();
  const int64_t inner = spec.inner(), grouped = spec.ssm.groups * spec.ssm.state_size;
  const Range x = layout.mamba_heads.Scaled(spec.ssm.head_dim);
  const Range groups = layout.mamba_groups.Scaled(spec.ssm.state_size);
  const std::vector<Range> channels =
      Joined({x, groups.Shifted(inner), groups.Shifted(inner + grouped)});
  std::vector<Range> rows = {x};
  for (const Range& c : channels) rows.push_back(c.Shifted(inner));
  rows.push_back(layout.mamba_heads.Shifted(2 * inner + 2 * grouped));
  rows = Joined(rows);
  const Range heads = layout.mamba_heads;
  TensorLoads loads;
  loads.emplace_back(&l->mamba_in_w, ld.OutputRows(m + "in_proj.weight", rows));
  loads.emplace_back(&l->mamba_out_w, ld.InputColumns(m + "out_proj.weight", x));
  if (spec.proj_bias) {
    loads.emplace_back(&l->mamba_in_b,
                       RowsOfWhole(ld, m + "in_proj.bias", {spec.projection()}, rows));
    loads.emplace_back(&l->mamba_out_b, ld.Whole(m + "out_proj.bias"));
  }
  // transformers' Conv1d keeps [C, 1, K].
  loads.emplace_back(&l->conv_w,
                     RowsOfWhole(ld, m + "conv1d.weight",
                                 {spec.conv_channels(), 1, spec.ssm.conv_kernel}, channels));
  if (spec.conv_bias) {
    loads.emplace_back(&l->conv_b,
                       RowsOfWhole(ld, m + "conv1d.bias", {spec.conv_channels()}, channels));
  }
  loads.emplace_back(&l->dt_bias, RowsOfWhole(ld, m + "dt_bias", {spec.ssm.heads}, {heads}));
  loads.emplace_back(&l->a_log, RowsOfWhole(ld, m + "A_log", {spec.ssm.heads}, {heads}));
  loads.emplace_back(&l->ssm_d, RowsOfWhole(ld, m + "D", {spec.ssm.heads}, {heads}));
  loads.emplace_back(&l->mamba_norm_w, ld.Whole(m + "norm.weight"));
  return AssignLoads(&loads);
}

bool IsQwenMoe(MoeLayout layout) {
  return layout == MoeLayout::kQwen2Moe || layout == MoeLayout::kQwen3Moe;
}

// config.json's expert counts: num_local_experts (Qwen2- and Qwen3-MoE: num_experts) experts,
// num_experts_per_tok of them a token.
absl::Status ReadExpertCounts(const ModelConfig& c, MoeLayout layout, DecoderSpec* s) {
  const char* count_key = IsQwenMoe(layout) ? "num_experts" : "num_local_experts";
  auto experts = c.Get<int64_t>(count_key);
  if (!experts.ok()) return experts.status();
  auto per_token = c.Get<int64_t>("num_experts_per_tok");
  if (!per_token.ok()) return per_token.status();
  if (*experts < 1 || *per_token < 1 || *per_token > *experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: num_experts_per_tok = ", *per_token, " with ", count_key, " = ",
                     *experts, ": expected 1 <= num_experts_per_tok <= ", count_key));
  }
  s->num_experts = *experts;
  s->experts_per_token = *per_token;
  return absl::OkStatus();
}

// Qwen2- and Qwen3-MoE's sizes and routing: every layer's MLP a mixture of experts of
// moe_intermediate_size columns (configs that keep some layers dense, through
// decoder_sparse_step or mlp_only_layers, are refused: intermediate_size is those layers'),
// Qwen2-MoE's shared expert of shared_expert_intermediate_size, norm_topk_prob.
absl::Status ReadQwenMoeKeys(const ModelConfig& c, MoeLayout layout, DecoderSpec* s) {
  auto inter = c.Get<int64_t>("moe_intermediate_size");
  auto shared = layout == MoeLayout::kQwen2Moe ? c.Get<int64_t>("shared_expert_intermediate_size")
                                               : absl::StatusOr<int64_t>(int64_t{0});
  auto step = c.Get<int64_t>("decoder_sparse_step", int64_t{1});
  auto normalize = c.Get<bool>("norm_topk_prob", false);
  for (const auto* v : {&inter, &shared, &step}) {
    if (!v->ok()) return v->status();
  }
  if (!normalize.ok()) return normalize.status();
  if (*step != 1) {
    return absl::UnimplementedError(absl::StrCat(
        "config.json: decoder_sparse_step = ", *step,
        ": dense MLP layers between the mixtures of experts are not supported (only 1)"));
  }
  if (auto dense = c.raw.find("mlp_only_layers");
      dense != c.raw.end() && !dense->is_null() && !(dense->is_array() && dense->empty())) {
    return absl::UnimplementedError(
        absl::StrCat("config.json: mlp_only_layers = ", dense->dump(),
                     ": dense MLP layers among the mixtures of experts are not supported"));
  }
  if (*inter <= 0 || *shared < 0 || (layout == MoeLayout::kQwen2Moe && *shared == 0)) {
    return absl::InvalidArgumentError(
        layout == MoeLayout::kQwen2Moe
            ? "config.json: moe_intermediate_size and shared_expert_intermediate_size must be "
              "positive"
            : "config.json: moe_intermediate_size must be positive");
  }
  s->intermediate = *inter;
  s->shared_expert_intermediate = *shared;
  s->routing = *normalize ? ExpertRouting::kSoftmaxTopKRenormalized : ExpertRouting::kSoftmaxTopK;
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadBiasKeys(const ModelConfig& c, bool mlp, LlamaStyleOptions* opt) {
  auto bias = c.Get<bool>("attention_bias", false);
  if (!bias.ok()) return bias.status();
  opt->qkv_bias = opt->o_bias = *bias;
  if (!mlp) return absl::OkStatus();
  auto mlp_bias = c.Get<bool>("mlp_bias", false);
  if (!mlp_bias.ok()) return mlp_bias.status();
  opt->mlp_bias = *mlp_bias;
  return absl::OkStatus();
}

absl::StatusOr<float> ReadMultiplier(const ModelConfig& c, const char* key, double absent) {
  auto v = c.Get<double>(key, absent);
  if (!v.ok()) return v.status();
  const float f = static_cast<float>(*v);  // as a float: 1e300 is no more finite than inf
  if (!std::isfinite(f) || f == 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: ", key, " = ", *v, ": expected a finite, non-zero number (as a float)"));
  }
  return f;
}

absl::Status UseGemmaLayout(const ModelConfig& c, const char* act_key, LlamaStyleOptions* opt) {
  opt->norm_plus_one = true;
  opt->embed_scale = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
  opt->embed_scale_in_act_dtype = true;
  opt->default_act = "gelu_pytorch_tanh";
  opt->act_key = act_key;
  const char* other =
      std::string_view(act_key) == "hidden_act" ? "hidden_activation" : "hidden_act";
  auto act = c.Get<std::string>(act_key, opt->default_act);
  if (!act.ok()) return act.status();
  auto declared = c.Get<std::string>(other, *act);
  if (!declared.ok()) return declared.status();
  if (*declared != *act) {
    LOG(WARNING) << "config.json: " << other << " \"" << *declared << "\" differs from " << act_key
                 << " \"" << *act << "\"; the MLP uses " << act_key << ", as transformers' "
                 << c.model_type << " does";
  }
  return absl::OkStatus();
}

absl::Status ReadPartialRotary(const ModelConfig& c, double absent, LlamaStyleOptions* opt) {
  auto partial = c.Get<double>("partial_rotary_factor", absent);
  if (!partial.ok()) return partial.status();
  opt->partial_rotary = *partial;
  return absl::OkStatus();
}

absl::Status RefuseQkNorms(const ModelConfig& c, const char* key, const char* who) {
  auto qk_norm = c.Get<bool>(key, false);
  if (!qk_norm.ok()) return qk_norm.status();
  if (!*qk_norm) return absl::OkStatus();
  return absl::UnimplementedError(
      absl::StrCat("config.json: ", key, " = true: per-head q and k LayerNorms",
                   *who != '\0' ? absl::StrCat(" (", who, ")") : "", " are not supported"));
}

absl::Status ReadSlidingWindow(const ModelConfig& c, LlamaStyleOptions* opt) {
  auto window = c.Get<int64_t>("sliding_window", int64_t{0});
  if (!window.ok()) return window.status();
  opt->sliding_window = static_cast<int>(*window);
  return absl::OkStatus();
}

absl::StatusOr<int> ReadWindowSize(const ModelConfig& c, int64_t absent) {
  auto w = c.Get<int64_t>("sliding_window", absent);
  if (!w.ok()) return w.status();
  if (*w <= 0 || *w > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: sliding_window = ", *w, ": expected a positive number"));
  }
  return static_cast<int>(*w);
}

absl::StatusOr<std::vector<int>> ReadLayerTypes(const ModelConfig& c, int window) {
  auto types = c.raw.find("layer_types");
  if (types == c.raw.end() || types->is_null()) return std::vector<int>{};
  if (!types->is_array() || static_cast<int64_t>(types->size()) != c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: layer_types: expected a list of ",
                                                   c.num_layers, " layer types"));
  }
  std::vector<int> windows(c.num_layers, 0);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const nlohmann::json& t = (*types)[l];
    if (t == "sliding_attention") {
      windows[l] = window;
    } else if (t != "full_attention") {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: layer_types[", l, "] = ", t.dump(),
                       ": expected \"full_attention\" or \"sliding_attention\""));
    }
  }
  return windows;
}

absl::StatusOr<std::vector<int>> ReadLayerTypesOrEvenLayers(const ModelConfig& c, int window) {
  auto windows = ReadLayerTypes(c, window);
  if (!windows.ok() || !windows->empty()) return windows;
  for (int64_t l = 0; l < c.num_layers; ++l) windows->push_back(l % 2 == 0 ? window : 0);
  return windows;
}

absl::StatusOr<float> ReadSoftCap(const ModelConfig& c, const char* key, double absent) {
  auto it = c.raw.find(key);
  if (it == c.raw.end()) return static_cast<float>(absent);
  if (it->is_null()) return 0.0f;
  auto v = c.Get<double>(key);
  if (!v.ok()) return v.status();
  const float f = static_cast<float>(*v);
  if (!std::isfinite(f) || f <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " = ", *v,
                                                   ": expected null or a positive, finite number"));
  }
  return f;
}

absl::Status ReadQueryPreAttnScalar(const ModelConfig& c, LlamaStyleOptions* opt) {
  auto scalar = c.Get<double>("query_pre_attn_scalar", 256.0);
  if (!scalar.ok()) return scalar.status();
  const float scale = static_cast<float>(std::pow(*scalar, -0.5));
  if (!(*scalar > 0) || !std::isfinite(scale) || scale == 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: query_pre_attn_scalar = ", *scalar,
                                                   ": expected a positive number"));
  }
  opt->attn_scale = scale;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CausalLM>> BuildLlamaStyle(const ModelConfig& c,
                                                          const WeightStore& w, DType dtype,
                                                          std::shared_ptr<Communicator> comm,
                                                          const LlamaStyleOptions& opt) {
  DecoderSpec s = MultiHeadSpec(c);
  s.num_kv_heads = c.num_kv_heads;  // GQA
  s.head_dim = c.head_dim;          // head_dim may differ from hidden / heads
  if (opt.head_dim_default > 0 && !c.raw.contains("head_dim")) s.head_dim = opt.head_dim_default;
  auto inter = c.Get<int64_t>(opt.intermediate_key);
  if (!inter.ok()) return inter.status();
  s.intermediate = *inter;
  auto eps = opt.fixed_norm_eps > 0 ? absl::StatusOr<double>(opt.fixed_norm_eps)
             : opt.layer_norm       ? c.Get<double>(opt.layer_norm_eps_key, 1e-5)
                                    : c.Get<double>("rms_norm_eps", opt.rms_norm_eps_default);
  if (!eps.ok()) return eps.status();
  s.norm = opt.layer_norm ? NormKind::kLayer : NormKind::kRms;
  s.norm_eps = static_cast<float>(*eps);
  s.mlp = opt.plain_mlp ? MlpKind::kPlain : MlpKind::kGated;
  // transformers' MLPs of these families take ACT2FN[hidden_act] (Gemma's gelu_pytorch_tanh;
  // Gemma 2's hidden_activation).
  auto act_name = c.Get<std::string>(opt.act_key, opt.default_act);
  if (!act_name.ok()) return act_name.status();
  auto act = ActivationFromName(*act_name, opt.act_key);
  if (!act.ok()) return act.status();
  s.act = *act;
  auto theta = c.Get<double>("rope_theta", 10000.0);
  if (!theta.ok()) return theta.status();
  s.rotary.style =
      opt.interleaved_rotary ? kernels::RotaryStyle::kGptj : kernels::RotaryStyle::kNeox;
  if (opt.parallel_residual) s.residual = Residual::kParallel;
  s.attn_scale = opt.attn_scale;  // before ReadRope, which folds YaRN's factor into it
  int rotary_dim = static_cast<int>(s.head_dim);
  if (opt.partial_rotary != 1.0) {
    auto dim = PartialRotaryDim(s.head_dim, opt.partial_rotary, "partial_rotary_factor");
    if (!dim.ok()) return dim.status();
    rotary_dim = *dim;
  }
  const float scale_before_rope = s.attn_scale;
  if (opt.no_positions) {
    // transformers reads neither rope_theta nor rope_scaling then; the context served is
    // max_position_embeddings.
    s.position = PositionKind::kNone;
  } else if (auto st = ReadRope(c, rotary_dim, *theta, &s); !st.ok()) {
    return st;
  }
  if (opt.sliding_rope_theta > 0) {
    // One attention scale and one set of frequencies a sequence are what the rope types that
    // scale attention (YaRN, LongRoPE) or follow the length (dynamic) give every layer; here
    // the windowed layers would not take them.
    if (s.rope_by_length.has_value() || s.attn_scale != scale_before_rope) {
      return absl::UnimplementedError(
          "config.json: rope_scaling: a rope type that scales attention or follows the "
          "sequence's length, beside rope_local_base_freq, is not supported (linear and llama3 "
          "are)");
    }
    s.sliding_rotary = s.rotary;
    s.sliding_rotary->inv_freq = kernels::RotaryInvFreq(rotary_dim, opt.sliding_rope_theta);
  }
  if (opt.max_positions_scaled) s.max_positions = 0;  // the config's max_position_embeddings
  s.sliding_window = opt.sliding_window;
  s.layer_windows = opt.layer_windows;
  if (opt.sandwich_norms) s.residual = Residual::kSandwich;
  if (opt.output_norms) s.residual = Residual::kOutputNorms;
  s.clip_qkv = opt.clip_qkv;
  s.qk_norms = opt.qk_norms;
  s.qk_norms_whole = opt.qk_norms_whole;
  s.attn_softcap = opt.attn_softcap;
  s.final_logit_softcap = opt.final_logit_softcap;
  s.embed_scale = opt.embed_scale;
  s.residual_scale = opt.residual_scale;
  s.logits_scale = opt.logits_scale;
  // LoRA adapters go on the attention's projections and the MLP's linears (Phi-3's fused
  // qkv_proj and gate_up_proj as one module each); in a mixture of experts on attention alone
  // (the experts' linears take none).
  LoraTargets& lt = s.lora_targets;
  lt.layers = "model.layers";
  lt.qkv = opt.fused_projections ? std::vector<std::string>{"self_attn.qkv_proj"}
                                 : std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj",
                                                            "self_attn.v_proj"};
  lt.o = absl::StrCat("self_attn.", opt.o_proj_name);
  if (opt.moe == MoeLayout::kNone && opt.plain_mlp) {
    lt.up = {absl::StrCat("mlp.", opt.plain_mlp_in)};
    lt.down = absl::StrCat("mlp.", opt.plain_mlp_out);
  } else if (opt.moe == MoeLayout::kNone && opt.granite_shared_mlp) {
    lt.up = {"shared_mlp.input_linear"};
    lt.down = "shared_mlp.output_linear";
  } else if (opt.moe == MoeLayout::kNone) {
    lt.up = opt.fused_projections ? std::vector<std::string>{"mlp.gate_up_proj"}
                                  : std::vector<std::string>{"mlp.gate_proj", "mlp.up_proj"};
    lt.down = "mlp.down_proj";
  }
  s.embed_scale_in_act_dtype = opt.embed_scale_in_act_dtype;
  s.mamba_layers = opt.mamba_layers;
  s.mamba = opt.mamba;
  if (opt.moe != MoeLayout::kNone) {
    if (auto st = ReadExpertCounts(c, opt.moe, &s); !st.ok()) return st;
  }
  // Mixtral's routing is DecoderSpec's default; Qwen2-MoE's follows norm_topk_prob below.
  if (opt.moe == MoeLayout::kGraniteMoe || opt.moe == MoeLayout::kGraniteMoeShared ||
      opt.moe == MoeLayout::kGptOss) {
    s.routing = ExpertRouting::kTopKSoftmax;
  }
  s.glu_alpha = opt.glu_alpha;
  s.glu_limit = opt.glu_limit;
  if (opt.moe == MoeLayout::kGraniteMoeShared) {
    s.shared_expert_intermediate = opt.shared_expert_intermediate;
    s.shared_expert_gated = false;
  }
  if (IsQwenMoe(opt.moe)) {
    if (auto st = ReadQwenMoeKeys(c, opt.moe, &s); !st.ok()) return st;
  }

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  const Range q = ld.q_rows(), kv = ld.kv_rows();
  DecoderWeights dw;
  auto embed = ld.VocabRows("model.embed_tokens.weight");
  if (!embed.ok()) return embed.status();
  dw.embed = *embed;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::string a = p + "self_attn.";
    LayerWeights l;
    if (s.IsMamba(i)) {
      if (auto st = LoadMamba(ld, p + "mamba.", s.mamba, &l); !st.ok()) return st;
    } else {
      auto qkv = opt.fused_projections ? ld.FusedQkv(a + "qkv_proj.weight", QkvLayout::kConcat)
                                       : ld.StackOutputRows({{a + "q_proj.weight", q},
                                                             {a + "k_proj.weight", kv},
                                                             {a + "v_proj.weight", kv}});
      if (!qkv.ok()) return qkv.status();
      l.qkv_w = *qkv;
      if (opt.qkv_bias) {
        auto b = ld.StackOutputRows(
            {{a + "q_proj.bias", q}, {a + "k_proj.bias", kv}, {a + "v_proj.bias", kv}});
        if (!b.ok()) return b.status();
        l.qkv_b = *b;
      }
      const std::string o_proj = a + opt.o_proj_name;
      auto o = ld.InputColumns(o_proj + ".weight", q);
      if (!o.ok()) return o.status();
      l.o_w = *o;
      if (opt.o_bias) {
        auto b = ld.Whole(o_proj + ".bias");
        if (!b.ok()) return b.status();
        l.o_b = *b;
      }
      if (opt.attention_sinks) {
        auto sinks = ld.Whole(a + "sinks");
        if (!sinks.ok()) return sinks.status();
        if (sinks->shape() != kernels::Shape{s.num_heads}) {
          return absl::InvalidArgumentError(absl::StrCat(a, "sinks: expected [", s.num_heads,
                                                         "], found [",
                                                         absl::StrJoin(sinks->shape(), ", "), "]"));
        }
        const float* all = sinks->data<float>();
        l.attn_sinks.assign(all + ld.layout().q_heads.begin, all + ld.layout().q_heads.end);
      }
    }
    if (auto st = opt.moe == MoeLayout::kNone ? LoadMlp(ld, p, s.intermediate, opt, &l)
                                              : LoadExperts(ld, p, s, opt.moe, &l);
        !st.ok()) {
      return st;
    }
    std::vector<std::tuple<std::string, Tensor*, Tensor*>> norms;
    if (!opt.output_norms) norms.emplace_back("input_layernorm", &l.ln1_w, &l.ln1_b);
    if (opt.qk_norms) {
      norms.insert(norms.end(), {{"self_attn.q_norm", &l.q_norm_w, &l.q_norm_b},
                                 {"self_attn.k_norm", &l.k_norm_w, &l.k_norm_b}});
    }
    if (opt.sandwich_norms) {
      norms.insert(norms.end(),
                   {{"post_attention_layernorm", &l.post_attn_norm_w, &l.post_attn_norm_b},
                    {"pre_feedforward_layernorm", &l.ln2_w, &l.ln2_b},
                    {"post_feedforward_layernorm", &l.post_mlp_norm_w, &l.post_mlp_norm_b}});
    } else if (opt.output_norms) {
      norms.insert(norms.end(),
                   {{"post_attention_layernorm", &l.post_attn_norm_w, &l.post_attn_norm_b},
                    {"post_feedforward_layernorm", &l.post_mlp_norm_w, &l.post_mlp_norm_b}});
    } else {
      norms.emplace_back("post_attention_layernorm", &l.ln2_w, &l.ln2_b);
    }
    for (auto [name, nw, nb] : norms) {
      if (opt.parallel_residual && nw == &l.ln2_w) {
        l.ln2_w = l.ln1_w;  // one norm feeds attention and the MLP
        l.ln2_b = l.ln1_b;
        continue;
      }
      if (auto st = LoadNorm(ld, p + name, opt, nw, nb); !st.ok()) return st;
    }
    dw.layers.push_back(std::move(l));
  }
  if (auto st = LoadNorm(ld, opt.final_norm_name, opt, &dw.final_norm_w, &dw.final_norm_b);
      !st.ok()) {
    return st;
  }
  if (opt.lm_head_bias) {
    auto b = ld.OutputRows("lm_head.bias", {ld.layout().vocab});
    if (!b.ok()) return b.status();
    dw.lm_head_b = *b;
  }
  return FinishDecoder(ld, w, "lm_head.weight", c.tie_word_embeddings, std::move(s), std::move(dw),
                       std::move(comm));
}

void RegisterLlamaStyle(ModelRegistry* r, const std::string& model_type, LlamaStyleReader read,
                        std::vector<std::string> ignored) {
  r->Register(
      model_type,
      [read = std::move(read)](
          const ModelConfig& c, const WeightStore& w, DType dtype,
          std::shared_ptr<Communicator> comm) -> absl::StatusOr<std::unique_ptr<Model>> {
        LlamaStyleOptions opt;
        if (auto st = read(c, &opt); !st.ok()) return st;
        return BuildLlamaStyle(c, w, dtype, std::move(comm), opt);
      },
      std::move(ignored));
}

void RegisterLlamaStyleWithExperts(ModelRegistry* r, const std::string& dense,
                                   const std::string& experts, MoeLayout layout,
                                   const LlamaStyleReader& read,
                                   const std::vector<std::string>& ignored) {
  for (const auto& [type, moe] : {std::pair{dense, MoeLayout::kNone}, std::pair{experts, layout}}) {
    const MoeLayout m = moe;
    RegisterLlamaStyle(
        r, type,
        [m, read](const ModelConfig& c, LlamaStyleOptions* opt) {
          opt->moe = m;
          return read(c, opt);
        },
        ignored);
  }
}

}  // namespace tgis::server

// IBM Granite (transformers' GraniteForCausalLM, Granite 3.x): the Llama layout with four
// multipliers: token embeddings times embedding_multiplier, attention scores times
// attention_multiplier (in place of 1/sqrt(head_dim)), each attention and MLP output times
// residual_multiplier before its residual add, and logits divided by logits_scaling.
// GraniteMoE (granitemoe: Granite 3.x's 1B-A400M and 3B-A800M) is the same with a mixture of
// experts in place of the MLP: a router (router.layer) scores num_local_experts experts, a
// token's num_experts_per_tok best ones run (input_linear [E, 2I, H] holding gate | up,
// output_linear [E, H, I]), weighted by a softmax over their scores.
// GraniteMoeShared (granitemoeshared) adds a shared expert that every token runs, added to the
// experts' sum unweighted (shared_mlp.input_linear [2S, H] holding gate | up,
// shared_mlp.output_linear [H, S]; S = shared_intermediate_size, 0: none).
// GraniteMoeHybrid (granitemoehybrid: Granite 4.0) makes each layer attention or a Mamba-2
// mixer (layer_types); its MLP is GraniteMoeShared's, or with num_local_experts 0 the shared
// MLP alone (Granite 4.0 Micro); attention rotates q and k when position_embedding_type is
// "rope" and takes no positions at all otherwise (Granite 4.0-H). A Mamba-2 layer
// (mamba.in_proj, conv1d, dt_bias, A_log, D, norm, out_proj; sizes from mamba_n_heads,
// mamba_d_head, mamba_n_groups, mamba_d_state, mamba_d_conv, mamba_expand, mamba_conv_bias,
// mamba_proj_bias) keeps each sequence's convolution and SSM states between steps
// (kernels::SelectiveScan; on the CPU, at world size 1 for now).
// Read only in training, so not here: output_router_logits and router_aux_loss_coef;
// mamba_chunk_size is how transformers splits a prompt for its parallel scan (the recurrence
// here gives the same states token by token). GraniteMoeHybrid without experts reads neither
// intermediate_size nor num_experts_per_tok (nor does transformers).

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/llama_style.h"

namespace tgis::server {

namespace {

absl::Status ReadOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  // GraniteMoE's config has attention_bias but no mlp_bias.
  const bool mlp_bias = opt->moe == MoeLayout::kNone && !opt->granite_shared_mlp;
  if (auto st = ReadBiasKeys(c, mlp_bias, opt); !st.ok()) return st;
  auto embed = ReadMultiplier(c, "embedding_multiplier");
  auto residual = ReadMultiplier(c, "residual_multiplier");
  auto attention = ReadMultiplier(c, "attention_multiplier");
  auto logits = ReadMultiplier(c, "logits_scaling");
  for (const auto* m : {&embed, &residual, &attention, &logits}) {
    if (!m->ok()) return m->status();
  }
  opt->embed_scale = *embed;
  opt->residual_scale = *residual;
  opt->attn_scale = *attention;
  // transformers divides the logits; one multiplication by the reciprocal is within an f32
  // rounding of that.
  opt->logits_scale = 1.0f / *logits;
  return absl::OkStatus();
}

// shared_intermediate_size (`absent`: the config class's default).
absl::Status ReadSharedExpert(const ModelConfig& c, int64_t absent, LlamaStyleOptions* opt) {
  auto shared = c.Get<int64_t>("shared_intermediate_size", absent);
  if (!shared.ok()) return shared.status();
  if (*shared < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: shared_intermediate_size = ", *shared, ": expected 0 or more"));
  }
  opt->shared_expert_intermediate = *shared;
  return absl::OkStatus();
}

absl::Status ReadSharedOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  opt->moe = MoeLayout::kGraniteMoeShared;
  if (auto st = ReadSharedExpert(c, 0, opt); !st.ok()) return st;
  return ReadOptions(c, opt);
}

// Which layers are Mamba-2 mixers (layer_types, or layers_block_type as older configs name it;
// absent: transformers makes every layer one), and their sizes from the mamba_* keys.
absl::Status ReadLayerTypes(const ModelConfig& c, LlamaStyleOptions* opt) {
  auto it = c.raw.find("layer_types");
  if (it == c.raw.end()) it = c.raw.find("layers_block_type");
  std::vector<bool> mamba(static_cast<size_t>(c.num_layers), true);
  if (it != c.raw.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: layer_types = ", it->dump(), ": expected one entry per layer (",
          c.num_layers, "), each \"attention\" or \"mamba\""));
    }
    for (size_t i = 0; i < mamba.size(); ++i) {
      const auto& type = (*it)[i];
      if (type != "mamba" && type != "attention") {
        return absl::InvalidArgumentError(absl::StrCat("config.json: layer_types holds ",
                                                       type.dump(),
                                                       ": expected \"attention\" or \"mamba\""));
      }
      mamba[i] = type == "mamba";
    }
  }
  if (std::none_of(mamba.begin(), mamba.end(), [](bool m) { return m; })) return absl::OkStatus();
  auto heads = c.Get<int64_t>("mamba_n_heads", 128);
  auto groups = c.Get<int64_t>("mamba_n_groups", 1);
  auto state = c.Get<int64_t>("mamba_d_state", 256);
  auto kernel = c.Get<int64_t>("mamba_d_conv", 4);
  auto expand = c.Get<double>("mamba_expand", 2.0);
  auto conv_bias = c.Get<bool>("mamba_conv_bias", true);
  auto proj_bias = c.Get<bool>("mamba_proj_bias", false);
  auto act = c.Get<std::string>("hidden_act", std::string("silu"));
  for (const auto* v : {&heads, &groups, &state, &kernel}) {
    if (!v->ok()) return v->status();
  }
  if (!expand.ok()) return expand.status();
  if (!conv_bias.ok()) return conv_bias.status();
  if (!proj_bias.ok()) return proj_bias.status();
  if (!act.ok()) return act.status();
  // transformers: int(mamba_expand * hidden_size) split into mamba_n_heads heads of
  // mamba_d_head ("auto": whatever that gives). Every size is bounded (2^20; the expanded width
  // 2^31) so that no product of them overflows.
  constexpr int64_t kMaxSize = int64_t{1} << 20;
  const double width = *expand * static_cast<double>(c.hidden_size);
  if (!(width >= 1 && width <= static_cast<double>(int64_t{1} << 31))) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: mamba_expand = ", *expand,
                                                   ": the expanded width must be in [1, 2^31]"));
  }
  for (const auto& [key, v] : {std::pair{"mamba_n_heads", *heads},
                               {"mamba_n_groups", *groups},
                               {"mamba_d_state", *state},
                               {"mamba_d_conv", *kernel}}) {
    if (v > kMaxSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", key, " = ", v, ": at most ", kMaxSize));
    }
  }
  const auto inner = static_cast<int64_t>(width);
  int64_t head_dim = *heads > 0 ? inner / *heads : 0;
  if (auto d = c.raw.find("mamba_d_head"); d != c.raw.end() && *d != "auto") {
    auto given = c.Get<int64_t>("mamba_d_head");
    if (!given.ok()) return given.status();
    head_dim = *given;
    if (head_dim > kMaxSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: mamba_d_head = ", head_dim, ": at most ", kMaxSize));
    }
  }
  if (*heads <= 0 || *groups <= 0 || *heads % *groups != 0 || *state <= 0 || *kernel < 1 ||
      head_dim <= 0 || head_dim * *heads != inner) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: the Mamba-2 sizes (mamba_n_heads ", *heads, ", mamba_d_head ", head_dim,
        ", mamba_n_groups ", *groups, ", mamba_d_state ", *state, ", mamba_d_conv ", *kernel,
        ", mamba_expand x hidden_size ", inner,
        ") must be positive, the heads a multiple of the groups, and heads x head_dim the "
        "expanded width"));
  }
  if (*act != "silu") {
    return absl::UnimplementedError(absl::StrCat("config.json: hidden_act = \"", *act,
                                                 "\": Mamba-2 layers are served with silu only"));
  }
  opt->mamba_layers = std::move(mamba);
  opt->mamba.ssm = {*heads, head_dim, *groups, *state, *kernel};
  opt->mamba.conv_bias = *conv_bias;
  opt->mamba.proj_bias = *proj_bias;
  return absl::OkStatus();
}

absl::Status ReadHybridOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = ReadLayerTypes(c, opt); !st.ok()) return st;
  auto positions = c.raw.find("position_embedding_type");
  if (positions == c.raw.end() || positions->is_null() || *positions == "nope") {
    opt->no_positions = true;
  } else if (*positions != "rope") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: position_embedding_type = ", positions->dump(),
                     ": expected \"rope\", \"nope\" or null"));
  }
  auto experts = c.Get<int64_t>("num_local_experts", 8);  // the config class's default
  if (!experts.ok()) return experts.status();
  if (*experts == 0) {
    opt->granite_shared_mlp = true;
    opt->intermediate_key = "shared_intermediate_size";
  } else {
    opt->moe = MoeLayout::kGraniteMoeShared;
    if (auto st = ReadSharedExpert(c, 1024, opt); !st.ok()) return st;
  }
  return ReadOptions(c, opt);
}

}  // namespace

void RegisterGraniteModel(ModelRegistry* r) {
  RegisterLlamaStyleWithExperts(r, "granite", "granitemoe", MoeLayout::kGraniteMoe, ReadOptions);
  RegisterLlamaStyle(r, "granitemoeshared", ReadSharedOptions);
  RegisterLlamaStyle(r, "granitemoehybrid", ReadHybridOptions);
}

}  // namespace tgis::server

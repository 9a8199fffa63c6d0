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
// "rope" and takes no positions at all otherwise (Granite 4.0-H). Mamba-2 layers are not
// served: a config with any is refused, by name.
// Read only in training, so not here: output_router_logits and router_aux_loss_coef. Read only
// by Mamba-2 layers, which a served GraniteMoeHybrid has none of: mamba_n_heads, mamba_d_head,
// mamba_n_groups, mamba_d_state, mamba_d_conv, mamba_expand, mamba_chunk_size,
// mamba_conv_bias, mamba_proj_bias. GraniteMoeHybrid without experts reads neither
// intermediate_size nor num_experts_per_tok (nor does transformers).

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

// Every layer attention (layer_types, or layers_block_type as older configs name it; absent:
// transformers makes every layer a Mamba-2 mixer).
absl::Status RequireAttentionLayers(const ModelConfig& c) {
  auto it = c.raw.find("layer_types");
  if (it == c.raw.end()) it = c.raw.find("layers_block_type");
  int64_t mamba = c.num_layers;
  if (it != c.raw.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: layer_types = ", it->dump(), ": expected one entry per layer (",
          c.num_layers, "), each \"attention\" or \"mamba\""));
    }
    mamba = 0;
    for (const auto& type : *it) {
      if (type == "mamba") {
        ++mamba;
      } else if (type != "attention") {
        return absl::InvalidArgumentError(absl::StrCat("config.json: layer_types holds ",
                                                       type.dump(),
                                                       ": expected \"attention\" or \"mamba\""));
      }
    }
  }
  if (mamba == 0) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "config.json: ", mamba, " of the ", c.num_layers,
      " layers are Mamba-2 mixers (layer_types \"mamba\", Granite 4.0-H's hybrid layout): "
      "state-space layers are not supported; attention-only GraniteMoeHybrid checkpoints "
      "(Granite 4.0 Micro) are"));
}

absl::Status ReadHybridOptions(const ModelConfig& c, LlamaStyleOptions* opt) {
  if (auto st = RequireAttentionLayers(c); !st.ok()) return st;
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

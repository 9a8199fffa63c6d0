// The Llama layout (norms, rotary, a gated or plain MLP, separate q/k/v/o projections), shared
// by the Llama/Mistral, Qwen2, Qwen3, Granite, Phi-2, Phi-3, Gemma, Gemma 2, Gemma 3, StableLM,
// StarCoder2, Cohere, OLMo, OLMo 2 and mixture-of-experts (Mixtral, GraniteMoE, Qwen2-/Qwen3-MoE)
// files, which differ in biases, sliding-window settings, Qwen3's and Gemma 3's q/k norms,
// Granite's multipliers, Phi-2's names and lm_head bias, Phi-3's fused projections, Gemma's norms
// and embedding scale, Gemma 2's extra norms and soft caps, Gemma 3's second rotary base, the
// LayerNorms of StableLM, StarCoder2, Cohere and OLMo, OLMo's clip_qkv, OLMo 2's output norms
// and whole-projection q/k norms, parallel residuals, and the experts.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/model_registry.h"
#include "server/weights.h"

namespace tgis::server {

// Where a mixture of experts' tensors are (DecoderSpec::num_experts; config.json's
// num_local_experts and num_experts_per_tok).
enum class MoeLayout {
  kNone,        // a dense MLP
  kMixtral,     // block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2
  kGraniteMoe,  // block_sparse_moe.router.layer, input_linear [E, 2I, H], output_linear [E, H, I]
  // GraniteMoE's experts and an ungated shared expert (shared_mlp.input_linear [2S, H] holding
  // gate | up, shared_mlp.output_linear [H, S]; LlamaStyleOptions::shared_expert_intermediate)
  kGraniteMoeShared,
  // mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj, and a shared expert
  // (mlp.shared_expert.*_proj) weighted by mlp.shared_expert_gate
  kQwen2Moe,
  // Qwen3-MoE: Qwen2-MoE's router and expert names, no shared expert
  kQwen3Moe,
  // GPT-OSS: mlp.router (weight [E, H] and bias), mlp.experts.gate_up_proj [E, H, 2I] (input
  // by output, gate and up columns interleaved) with gate_up_proj_bias [E, 2I], down_proj
  // [E, I, H] with down_proj_bias [E, H]; or MXFP4 blocks and scales for the two weights
  kGptOss,
};

struct LlamaStyleOptions {
  bool qkv_bias = false;  // q/k/v_proj biases (Qwen2; Llama's attention_bias)
  bool o_bias = false;    // o_proj bias (Llama's attention_bias)
  bool mlp_bias = false;  // gate/up/down_proj (or c_fc/c_proj) biases (Llama's mlp_bias)
  int sliding_window = 0;
  // Phi-3: one qkv_proj (q rows, then k, then v) and one gate_up_proj ([gate | up]) where
  // Llama has q/k/v_proj and gate/up_proj; the part of each head that rotates.
  bool fused_projections = false;
  double partial_rotary = 1.0;
  // Gemma: RMSNorm weights applied as (1 + w); the embeddings times sqrt(hidden) rounded to the
  // activations' dtype (embed_scale, embed_scale_in_act_dtype); hidden_act's default.
  bool norm_plus_one = false;
  // StarCoder2: LayerNorms with biases (norm_epsilon) and a plain MLP (c_fc, act, c_proj;
  // mlp_bias gives their biases). Cohere: LayerNorms without biases (layer_norm_eps).
  bool layer_norm = false;
  bool norm_bias = true;
  const char* layer_norm_eps_key = "norm_epsilon";
  bool plain_mlp = false;
  bool embed_scale_in_act_dtype = false;
  std::string default_act = "silu";
  // Granite's multipliers (DecoderSpec's embed_scale, residual_scale, logits_scale); 0: the
  // default 1/sqrt(head_dim) attention scale.
  float embed_scale = 1;
  float residual_scale = 1;
  float logits_scale = 1;
  float attn_scale = 0;
  MoeLayout moe = MoeLayout::kNone;
  // Cohere: one norm a layer (input_layernorm) feeding attention and the MLP, whose outputs
  // join the residual together (Residual::kParallel); rotary on interleaved pairs (GPT-J's).
  bool parallel_residual = false;
  bool interleaved_rotary = false;
  // The config key that names the MLP's activation (Gemma 2's MLP takes hidden_activation).
  const char* act_key = "hidden_act";
  // Gemma 2: four norms a layer (input_layernorm and post_attention_layernorm around attention,
  // pre_feedforward_layernorm and post_feedforward_layernorm around the MLP:
  // Residual::kSandwich); soft caps on attention and output logits (0: none).
  bool sandwich_norms = false;
  float attn_softcap = 0;
  float final_logit_softcap = 0;
  // Each layer's window when not empty (DecoderSpec::layer_windows: Gemma 2's even layers,
  // Qwen3's and Gemma 3's layer_types); else sliding_window for every layer.
  std::vector<int> layer_windows;
  // Gemma 3: the rotary base of the layers with a window (rope_local_base_freq), unscaled
  // (DecoderSpec::sliding_rotary); 0: every layer takes rope_theta and rope_scaling.
  double sliding_rope_theta = 0;
  // Gemma 3: max_position_embeddings is already the context rope_scaling gives (131072 with
  // linear x8), so the positions served are it, not it times the factor (vLLM serves Gemma 3
  // so too).
  bool max_positions_scaled = false;
  // Phi: the attention's output projection, the plain MLP's two linears and the final norm
  // under other names; a bias on the lm_head.
  const char* o_proj_name = "o_proj";
  const char* plain_mlp_in = "c_fc";
  const char* plain_mlp_out = "c_proj";
  const char* final_norm_name = "model.norm";
  bool lm_head_bias = false;
  // OLMo: LayerNorms without weights or biases (as weight 1, no bias) and with a fixed eps
  // (fixed_norm_eps > 0: no config key); q, k and v clamped to [-clip_qkv, clip_qkv] (0: none).
  bool norm_weights = true;
  double fixed_norm_eps = 0;
  float clip_qkv = 0;
  // head_dim when config.json has none (Gemma 2's config class defaults it to 256, not
  // hidden / heads); 0: hidden / heads.
  int64_t head_dim_default = 0;
  // Qwen3: self_attn.q_norm and k_norm, one [head_dim] norm for every q head and one for every
  // k head, before rotary (DecoderSpec::qk_norms); OLMo 2 (qk_norms_whole): each over the whole
  // q or k projection.
  bool qk_norms = false;
  bool qk_norms_whole = false;
  // OLMo 2: two norms a layer, of the attention's and the MLP's outputs (post_attention_layernorm,
  // post_feedforward_layernorm: Residual::kOutputNorms), none of their inputs.
  bool output_norms = false;
  // rms_norm_eps when config.json has none (the config class's default).
  double rms_norm_eps_default = 1e-6;
  // GraniteMoeShared's and GraniteMoeHybrid's shared expert's columns (kGraniteMoeShared).
  int64_t shared_expert_intermediate = 0;
  // GraniteMoeHybrid without experts (Granite 4.0 Micro): the dense MLP is the shared one,
  // shared_mlp.input_linear (gate | up) and shared_mlp.output_linear, `intermediate_key`
  // columns wide.
  bool granite_shared_mlp = false;
  const char* intermediate_key = "intermediate_size";
  // NoPE: no positions at all (GraniteMoeHybrid's position_embedding_type other than "rope").
  bool no_positions = false;
  // GraniteMoeHybrid: the layers that are Mamba-2 mixers in place of attention (empty: none),
  // and their sizes (DecoderSpec::mamba_layers, mamba).
  std::vector<bool> mamba_layers;
  MambaSpec mamba;
  // GPT-OSS: self_attn.sinks [heads] (kernels::AttentionBias::sinks), and the experts'
  // clamped SwiGLU (DecoderSpec::glu_alpha, glu_limit; 0: plain).
  bool attention_sinks = false;
  float glu_alpha = 0;
  float glu_limit = 0;
};

// config.json's attention_bias (q/k/v and o biases) and, with `mlp`, mlp_bias (Llama's and
// Granite's keys; Gemma has only the first).
absl::Status ReadBiasKeys(const ModelConfig& config, bool mlp, LlamaStyleOptions* options);
// A multiplier from config.json (Granite's, Cohere's logit_scale): `absent` when the key is
// absent (transformers' default); finite and non-zero as a float.
absl::StatusOr<float> ReadMultiplier(const ModelConfig& config, const char* key,
                                     double absent = 1.0);
// Gemma's (1 + w) RMSNorm weights and sqrt(hidden) embedding scale rounded to the activations'
// dtype (Gemma 1 and 2); the MLP's activation from `act_key` (gelu_pytorch_tanh by default), with
// a warning when the other of hidden_act / hidden_activation names another one.
absl::Status UseGemmaLayout(const ModelConfig& config, const char* act_key,
                            LlamaStyleOptions* options);
// config.json's partial_rotary_factor, `absent` when it has none (the config class's default).
absl::Status ReadPartialRotary(const ModelConfig& config, double absent,
                               LlamaStyleOptions* options);
// Per-head q and k norms, flagged by `key` (Cohere's use_qk_norm, StableLM's and Phi's
// qk_layernorm): true is refused; `who` (may be empty) says which checkpoints set it.
absl::Status RefuseQkNorms(const ModelConfig& config, const char* key, const char* who);
// config.json's sliding_window (absent: none), as Mistral, Phi-3 and StarCoder2 name it.
absl::Status ReadSlidingWindow(const ModelConfig& config, LlamaStyleOptions* options);
// config.json's sliding_window as a positive key count (`absent` when the key is absent; a
// null one is the caller's to read first: Qwen3 takes it as no window, Gemma 3 refuses it).
absl::StatusOr<int> ReadWindowSize(const ModelConfig& config, int64_t absent);
// config.json's layer_types (transformers writes it for models that mix windowed and full
// attention layers): each layer's window, `window` for "sliding_attention" and 0 for
// "full_attention". Absent or null: an empty list (the family's own rule applies).
absl::StatusOr<std::vector<int>> ReadLayerTypes(const ModelConfig& config, int window);
// ReadLayerTypes, or without layer_types `window` on the even layers and full attention on the
// odd ones (Gemma2Config's and GptOssConfig's rule).
absl::StatusOr<std::vector<int>> ReadLayerTypesOrEvenLayers(const ModelConfig& config, int window);
// A soft cap (Gemma 2's and 3's attn_logit_softcapping, final_logit_softcapping): `absent` when
// config.json has no such key, 0 (none) for null, else a positive, finite float.
absl::StatusOr<float> ReadSoftCap(const ModelConfig& config, const char* key, double absent);
// Gemma 2's and 3's attention scale, query_pre_attn_scalar^-0.5 (256 when absent).
absl::Status ReadQueryPreAttnScalar(const ModelConfig& config, LlamaStyleOptions* options);

// What a family reads from config.json into its options; the layout's own keys (sizes,
// rotary, rope scaling, norms' eps, the MLP's activation) are BuildLlamaStyle's.
using LlamaStyleReader = std::function<absl::Status(const ModelConfig&, LlamaStyleOptions*)>;

absl::StatusOr<std::unique_ptr<CausalLM>> BuildLlamaStyle(const ModelConfig& config,
                                                          const WeightStore& weights,
                                                          kernels::DType dtype,
                                                          std::shared_ptr<Communicator> comm,
                                                          const LlamaStyleOptions& options);
// Registers `model_type` as the Llama layout with the options `read` gives (BuildLlamaStyle);
// `ignored` as ModelRegistry::Register takes it.
void RegisterLlamaStyle(ModelRegistry* registry, const std::string& model_type,
                        LlamaStyleReader read, std::vector<std::string> ignored = {});
// A dense family and its mixture of experts (Granite and GraniteMoE, Qwen2 and Qwen2-MoE,
// Qwen3 and Qwen3-MoE): `dense` with MoeLayout::kNone, `experts` with `layout`, set in
// LlamaStyleOptions::moe before `read` runs.
void RegisterLlamaStyleWithExperts(ModelRegistry* registry, const std::string& dense,
                                   const std::string& experts, MoeLayout layout,
                                   const LlamaStyleReader& read,
                                   const std::vector<std::string>& ignored = {});

}  // namespace tgis::server

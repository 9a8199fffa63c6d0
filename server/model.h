// The engine's view of a model, decoder-only (CausalLM, decoder_model.h) or encoder-decoder
// (models/t5.cc): the sizes it sizes the KV cache and checks requests by, one step's ragged
// batch (ForwardInput) and the Model interface. A family is one file under models/ that builds
// a Model from shared layers, plus a registry line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/rope_scaling.h"
#include "kernels/tensor.h"
#include "server/communicator.h"
#include "server/moe.h"

namespace tgis::server {

struct LoraAdapter;
struct LoraWeights;

enum class NormKind { kRms, kLayer };
enum class MlpKind {
  kGated,  // down(act(gate(x)) * up(x)); up_w holds [gate | up]
  kPlain,  // proj(act(fc(x)))
};
// Position schemes: rotary on q and k; learned absolute embeddings added to the input
// (pos_embed); ALiBi slopes added to the attention logits; none (NoPE: Granite 4.0-H's
// attention layers, which learn order from the causal mask alone).
enum class PositionKind { kRotary, kLearned, kAlibi, kRelative /* T5 buckets */, kNone };
enum class Residual {
  kSequential,  // x += attn(ln1(x)); x += mlp(ln2(x))
  kParallel,    // x += attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX, Falcon; ln2 may be ln1's tensors)
  kPostNorm,    // x = ln1(x + attn(x)); x = ln2(x + mlp(x)) (OPT-350m)
  // x += post_attn_norm(attn(ln1(x))); x += post_mlp_norm(mlp(ln2(x))) (Gemma 2)
  kSandwich,
  // x += post_attn_norm(attn(x)); x += post_mlp_norm(mlp(x)) (OLMo 2: each sublayer's output
  // is normed, not its input)
  kOutputNorms,
};

// Where a LoRA adapter's modules (PEFT's paths: `<layers>.<i>.<module>`) go in a decoder layer:
// the checkpoint modules that make each fused linear's output rows, in order (q, k, v; gate,
// up), or one module that makes them all (Phi-3's qkv_proj: q rows, then k, then v; a gated
// MLP's gate_up_proj: gate rows, then up). Empty `layers`: the model serves no LoRA adapters;
// an empty list or name: that linear takes none.
struct LoraTargets {
  std::string layers;            // "model.layers"
  std::vector<std::string> qkv;  // "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
  std::string o;                 // "self_attn.o_proj"
  std::vector<std::string> up;   // "mlp.gate_proj", "mlp.up_proj" (a plain MLP: its one input)
  std::string down;              // "mlp.down_proj"
};

// Mamba-2 mixers in place of attention (GraniteMoeHybrid's "mamba" layers). Each sequence keeps,
// per such layer, a convolution state [conv_channels, conv_kernel - 1] and an SSM state
// [heads, head_dim, state_size] (f32) from one step to the next (Engine's recurrent slots).
struct MambaSpec {
  kernels::SsmConfig ssm;
  bool proj_bias = false;  // in_proj and out_proj biases (mamba_proj_bias)
  bool conv_bias = true;   // mamba_conv_bias
  int64_t inner() const { return ssm.heads * ssm.head_dim; }
  int64_t conv_channels() const { return inner() + 2 * ssm.groups * ssm.state_size; }
  int64_t projection() const { return inner() + conv_channels() + ssm.heads; }
};

struct DecoderSpec {
  int64_t hidden = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  NormKind norm = NormKind::kRms;
  float norm_eps = 1e-6f;
  MlpKind mlp = MlpKind::kGated;
  kernels::Activation act = kernels::Activation::kSilu;
  PositionKind position = PositionKind::kRotary;
  std::vector<float> alibi_slopes;  // kAlibi: one per head; empty: kernels::AlibiSlopes
  kernels::RotaryConfig rotary;     // the frequencies within the original context
  // Gemma 3: the frequencies of the layers with a window (rope_local_base_freq, unscaled), where
  // the others take `rotary`; none: every layer takes `rotary`.
  std::optional<kernels::RotaryConfig> sliding_rotary;
  // Rope types whose frequencies follow each sequence's length (dynamic NTK, LongRoPE).
  std::optional<kernels::RopeScaling> rope_by_length;
  // Positions served; 0: the config's max_position_embeddings; < 0: no limit of the model's own
  // (relative positions), the router's MAX_SEQUENCE_LENGTH bounds sequences.
  int64_t max_positions = 0;
  // The positions served, given the config's max_position_embeddings; 0: no limit.
  int64_t ServedPositions(int64_t config_max_positions) const {
    if (max_positions < 0) return 0;
    return max_positions > 0 ? max_positions : config_max_positions;
  }
  Residual residual = Residual::kSequential;
  // Token embeddings (and the lm_head) narrower than the model, projected in and out (OPT's
  // word_embed_proj_dim); 0: hidden.
  int64_t embed_dim = 0;
  bool embed_norm = false;  // a norm right after the token embedding (BLOOM)
  float clip_qkv = 0;       // > 0: q, k and v clamped to [-clip_qkv, clip_qkv] (MPT)
  // Each q head and each k head normed over its head_dim values (`norm`, norm_eps) before
  // rotary, with LayerWeights::q_norm_w / k_norm_w (Qwen3).
  bool qk_norms = false;
  // With qk_norms: q and k each normed over the whole projection, every head of every rank
  // ([Hq * D] and [Hk * D] weights; OLMo 2), not head by head.
  bool qk_norms_whole = false;
  int64_t EmbedDim() const { return embed_dim > 0 ? embed_dim : hidden; }
  int sliding_window = 0;
  // Per layer when not empty (Gemma 2: sliding_window on the even layers, 0 on the odd ones);
  // else every layer has sliding_window.
  std::vector<int> layer_windows;
  int WindowOf(int64_t layer) const {
    return layer_windows.empty() ? sliding_window : layer_windows[layer];
  }
  const kernels::RotaryConfig& RotaryOf(int64_t layer) const {
    return sliding_rotary && WindowOf(layer) > 0 ? *sliding_rotary : rotary;
  }
  float attn_scale = 0;  // 0: 1/sqrt(head_dim)
  // Gemma 2's soft caps (0: none): each scaled attention logit and each f32 output logit
  // become tanh(v / cap) * cap (AttentionBias::softcap, kernels::SoftCap).
  float attn_softcap = 0;
  float final_logit_softcap = 0;
  // Granite's multipliers (1: none): the token embeddings, each attention and MLP output before
  // its residual add, and the f32 logits (1 / logits_scaling) are multiplied by them.
  float embed_scale = 1;
  float residual_scale = 1;
  float logits_scale = 1;
  // Gemma: embed_scale (sqrt(hidden)) rounded to the activations' dtype first, as transformers
  // makes it a tensor of that dtype.
  bool embed_scale_in_act_dtype = false;
  // A mixture of experts in place of the MLP (Mixtral, GraniteMoE, Qwen2-MoE): a router scores
  // num_experts experts of `intermediate` columns each per token, and the token's MLP output
  // is the weighted sum of its experts_per_token best ones (RouteTokens). 0: a dense MLP.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  ExpertRouting routing = ExpertRouting::kSoftmaxTopKRenormalized;
  // Qwen2-MoE, GraniteMoeShared: a shared expert (a gated MLP of this many columns) that every
  // token runs, its output added to the experts'; 0: none. Gated (Qwen2-MoE): times
  // sigmoid(shared gate . x), the gate being the router's last row; else (Granite) times 1.
  int64_t shared_expert_intermediate = 0;
  bool shared_expert_gated = true;
  // GPT-OSS: each expert's gate|up goes through kernels::ClampedSwiGlu(glu_alpha, glu_limit)
  // in place of act(gate) * up; 0: the plain gated activation.
  float glu_limit = 0;
  float glu_alpha = 0;
  // Per layer: true where a Mamba-2 mixer (`mamba`) stands in place of attention; empty: none.
  std::vector<bool> mamba_layers;
  MambaSpec mamba;
  bool IsMamba(int64_t layer) const {
    return !mamba_layers.empty() && mamba_layers[static_cast<size_t>(layer)];
  }
  // The shapes of one sequence's recurrent states: per Mamba-2 layer in order, its convolution
  // state then its SSM state; empty: the model keeps none.
  std::vector<kernels::Shape> RecurrentStateShapes() const;
  LoraTargets lora_targets;
};

// A half-open range of indices [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  Range Scaled(int64_t k) const { return {begin * k, end * k}; }
  Range Shifted(int64_t by) const { return {begin + by, end + by}; }
};

// The part of a DecoderSpec's model that one tensor-parallel rank holds (world size 1: all).
struct ShardLayout {
  int rank = 0;
  int world_size = 1;
  Range q_heads;   // attention heads: q rows of the fused qkv, input columns of o_proj
  Range kv_heads;  // key/value heads (a slice, or the one this rank's q heads share)
  bool kv_replicated = false;
  Range intermediate;       // MLP columns: up (and gate) rows, down input columns
  Range shared_expert;      // the shared expert's columns (DecoderSpec::shared_expert_intermediate)
  Range vocab;              // embedding and lm_head rows
  int64_t vocab_chunk = 0;  // vocab rows per rank, ceil(V / world_size); the last may hold fewer
  // Mamba-2 mixers: this rank's heads (their z, x and dt rows of in_proj, x channels of the
  // convolution, out_proj input columns) and the groups of B and C they read: a slice of the
  // groups when the world size divides them, else the one group the rank's heads all share
  // (Granite 4.0-H has one group: every rank keeps it). `mamba` is the rank's mixer, those
  // heads and groups.
  Range mamba_heads;
  Range mamba_groups;
  MambaSpec mamba;

  // Splits `spec` over `world_size` ranks: attention heads and the MLP evenly (both must be
  // divisible by the world size); KV heads evenly when there are at least as many as ranks,
  // else each rank keeps the one KV head its q heads use (MQA, few KV heads); the vocabulary
  // in chunks of ceil(V / world_size); Mamba-2 heads evenly, their groups as said above.
  static absl::StatusOr<ShardLayout> Make(const DecoderSpec& spec, int rank, int world_size);

  // Rows of this rank's q, k and v in projections laid out head by head (head_dim `d`).
  Range q_rows(int64_t d) const { return q_heads.Scaled(d); }
  Range kv_rows(int64_t d) const { return kv_heads.Scaled(d); }
};

// One step's ragged batch, on the model's device.
struct ForwardInput {
  kernels::Tensor input_ids;     // [T] i32
  kernels::Tensor positions;     // [T] i32
  kernels::Tensor slot_mapping;  // [T] i32
  kernels::AttentionBatch attn;
  // Prompt tuning: when defined, row i of the input embeddings is row embedding_source[i] of
  // [token embeddings; prefix_values] ([T] i32), so virtual tokens take the prefix's vectors.
  kernels::Tensor embedding_source;
  kernels::Tensor prefix_values;  // [R, hidden] in the activation dtype
  // The attention batch's query_start and context_lens on the host, for the ops that vary by
  // sequence (length-dependent rotary).
  std::vector<int32_t> host_query_start;
  std::vector<int32_t> host_context_lens;
  // Encoder-decoder decoder steps: each sequence's (one) query row against its encoder's
  // cross-attention keys/values (non-causal; context_lens = input lengths).
  kernels::AttentionBatch cross_attn;
  // LoRA adapters: the rows of the step ([n] i32) that take each adapter's deltas, and the
  // adapter's scale for each of them ([n] f32).
  struct LoraRows {
    const LoraWeights* adapter = nullptr;
    kernels::Tensor rows, scales;
    bool all_rows = false;  // rows are 0..T-1, every row of the step in order
  };
  std::vector<LoraRows> lora;
  // Models with recurrent states (DecoderSpec::RecurrentStateShapes): each sequence's (the
  // engine's slot for it, one tensor per shape), and whether its rows in this step start at
  // position 0 (its states start from zero).
  std::vector<std::vector<kernels::Tensor>*> recurrent;
  std::vector<uint8_t> recurrent_fresh;
};

// Decoder-only models run Forward over the prompt, then over each generated token. Encoder-
// decoder models Encode the input once (its cross-attention keys and values go to the
// sequence's own cache blocks), then run Forward over the decoder's tokens from the decoder
// start token, with ForwardInput::cross_attn naming those blocks.
class Model {
 public:
  virtual ~Model() = default;

  // Runs the batch, writing its keys/values into `cache` (one entry per decoder layer), and
  // returns the logits [rows, V] (the whole vocabulary, on every rank) of the token rows listed
  // in `logit_rows`. Every rank of the group must run the same batch at the same time.
  kernels::Tensor Forward(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                          const std::vector<int32_t>& logit_rows) const {
    return Logits(ForwardHidden(in, cache, logit_rows));
  }
  // Forward in two parts: the final hidden states of the `logit_rows` ([rows, EmbedDim], as
  // the lm_head takes them), then the logits of any rows of those, as many calls as wanted (a
  // long prompt's details a chunk at a time). Every rank makes the same calls.
  virtual kernels::Tensor ForwardHidden(const ForwardInput& in,
                                        std::vector<kernels::KvCacheLayer>* cache,
                                        const std::vector<int32_t>& logit_rows) const = 0;
  virtual kernels::Tensor Logits(const kernels::Tensor& hidden) const = 0;

  virtual bool encoder_decoder() const { return false; }
  virtual int32_t decoder_start_token() const { return 0; }
  // Encoder-decoder models: runs the encoder over `in` (the inputs' tokens; in.attn a
  // non-causal batch over each sequence's cross-attention blocks, in.slot_mapping their slots)
  // and stores every decoder layer's cross-attention keys and values in those slots.
  virtual void Encode(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache) const {
    (void)in;
    (void)cache;
  }

  // Moves the weights to `device`; on the CPU, where they are, makes what the CPU kernels
  // derive from them (kernels::PrepareCpuWeight: at load, before the KV cache is sized from the
  // memory left). Call once, before the first Forward.
  virtual void MoveTo(kernels::Device device) = 0;
  // A LoRA adapter made for this rank (after MoveTo: on the model's device, in its activation
  // dtype); an error when the model serves none or the adapter does not fit it.
  virtual absl::StatusOr<std::shared_ptr<const LoraWeights>> MakeLora(
      const LoraAdapter& adapter) const;
  virtual kernels::Device device() const = 0;
  // The dtype of activations: f32 on the CPU.
  virtual kernels::DType act_dtype() const = 0;
  // The dtype of the KV cache (KvCacheDType).
  virtual kernels::DType kv_dtype() const = 0;
  // The (decoder) stack's sizes for the whole model, and this rank's part of it.
  virtual const DecoderSpec& spec() const = 0;
  virtual const ShardLayout& shard() const = 0;
  virtual Communicator& communicator() const = 0;
  // Bytes of this rank's KV cache per token (all cache layers, its KV heads, keys and values).
  virtual size_t KvBytesPerToken() const = 0;
};

}  // namespace tgis::server

// A decoder-only transformer assembled from shared layers. Architectures differ only in a
// DecoderSpec (norms, MLP kind, positions, residual layout) and in how their checkpoint names
// map onto DecoderWeights; each architecture's file under models/ does that mapping.
//
// Tensor parallel: a CausalLM is one rank's part of the model (ShardLayout) and runs its forward
// pass together with the other ranks through a Communicator: column-parallel q/k/v and MLP up
// projections, row-parallel o_proj and MLP down projections (one all-reduce after attention and
// one after the MLP, or one per layer with a parallel residual), vocab-parallel embedding (an
// all-reduce) and lm_head (an all-gather, so every rank holds the full logits).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/rope_scaling.h"
#include "kernels/tensor.h"
#include "server/communicator.h"

namespace tgis::server {

enum class NormKind { kRms, kLayer };
enum class MlpKind {
  kGatedSilu,  // down(silu(gate(x)) * up(x)); up_w holds [gate | up]
  kPlain,      // proj(act(fc(x)))
};
// Position schemes: rotary on q and k; learned absolute embeddings added to the input
// (pos_embed); ALiBi slopes added to the attention logits.
enum class PositionKind { kRotary, kLearned, kAlibi };
enum class Residual {
  kSequential,  // x += attn(ln1(x)); x += mlp(ln2(x))
  kParallel,    // x += attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX, Falcon; ln2 may be ln1's tensors)
  kPostNorm,    // x = ln1(x + attn(x)); x = ln2(x + mlp(x)) (OPT-350m)
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
  MlpKind mlp = MlpKind::kGatedSilu;
  kernels::Activation act = kernels::Activation::kGeluTanh;  // kPlain MLPs
  PositionKind position = PositionKind::kRotary;
  std::vector<float> alibi_slopes;  // kAlibi: one per head; empty: kernels::AlibiSlopes
  kernels::RotaryConfig rotary;     // the frequencies within the original context
  // Rope types whose frequencies follow each sequence's length (dynamic NTK, LongRoPE).
  std::optional<kernels::RopeScaling> rope_by_length;
  int64_t max_positions = 0;  // positions served; 0: the config's max_position_embeddings
  Residual residual = Residual::kSequential;
  // Token embeddings (and the lm_head) narrower than the model, projected in and out (OPT's
  // word_embed_proj_dim); 0: hidden.
  int64_t embed_dim = 0;
  bool embed_norm = false;  // a norm right after the token embedding (BLOOM)
  float clip_qkv = 0;       // > 0: q, k and v clamped to [-clip_qkv, clip_qkv] (MPT)
  int64_t EmbedDim() const { return embed_dim > 0 ? embed_dim : hidden; }
  int sliding_window = 0;
  float attn_scale = 0;  // 0: 1/sqrt(head_dim)
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
  Range vocab;              // embedding and lm_head rows
  int64_t vocab_chunk = 0;  // vocab rows per rank, ceil(V / world_size); the last may hold fewer

  // Splits `spec` over `world_size` ranks: attention heads and the MLP evenly (both must be
  // divisible by the world size); KV heads evenly when there are at least as many as ranks,
  // else each rank keeps the one KV head its q heads use (MQA, few KV heads); the vocabulary
  // in chunks of ceil(V / world_size).
  static absl::StatusOr<ShardLayout> Make(const DecoderSpec& spec, int rank, int world_size);

  // Rows of this rank's q, k and v in projections laid out head by head (head_dim `d`).
  Range q_rows(int64_t d) const { return q_heads.Scaled(d); }
  Range kv_rows(int64_t d) const { return kv_heads.Scaled(d); }
};

// One rank's weights: shapes use the rank's local sizes (ShardLayout): Hq, Hk, I and V below
// are this rank's heads, KV heads, MLP columns and vocabulary rows.
struct LayerWeights {
  kernels::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // biases undefined for RMSNorm
  kernels::Tensor qkv_w, qkv_b;                // [(Hq + 2 Hk) * D, H]: q rows, then k, then v
  kernels::Tensor o_w, o_b;                    // [H, Hq * D]; the bias whole (added once)
  kernels::Tensor up_w, up_b;                  // [2I, H] ([gate | up]) or [I, H]
  kernels::Tensor down_w, down_b;              // [H, I]; the bias whole (added once)
};

struct DecoderWeights {
  kernels::Tensor embed;                       // [V, E] (E: EmbedDim())
  kernels::Tensor embed_norm_w, embed_norm_b;  // [H] (embed_norm)
  kernels::Tensor project_in, project_out;     // [H, E] and [E, H] when E != H
  kernels::Tensor pos_embed;  // [P, H] learned positions (whole; row p is position p), or undefined
  std::vector<LayerWeights> layers;
  kernels::Tensor final_norm_w, final_norm_b;  // undefined: no final norm (post-norm layouts)
  kernels::Tensor lm_head;                     // [V, E]; may share storage with embed
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
};

class CausalLM {
 public:
  // `weights` hold the part of the model that `comm`'s rank owns (ShardLayout::Make of `spec`);
  // a null `comm` means world size 1.
  CausalLM(DecoderSpec spec, DecoderWeights weights, std::shared_ptr<Communicator> comm = nullptr);
  // Runs the batch, writing its keys/values into `cache` (one entry per layer), and returns
  // the logits [rows, V] (the whole vocabulary, on every rank) of the token rows listed in
  // `logit_rows`. Every rank of the group must run the same batch at the same time.
  kernels::Tensor Forward(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                          const std::vector<int32_t>& logit_rows) const;
  // Moves the weights to `device` (CPU: no-op). On CUDA the activations and the KV cache take
  // the linear weights' dtype, and every other tensor (norms, biases) is converted to it too.
  // Call once, before the first Forward.
  void MoveTo(kernels::Device device);
  kernels::Device device() const { return device_; }
  // The dtype of activations and of the KV cache: f32 on the CPU.
  kernels::DType act_dtype() const { return act_dtype_; }
  const DecoderSpec& spec() const { return spec_; }  // the whole model's sizes
  const ShardLayout& shard() const { return layout_; }
  Communicator& communicator() const { return *comm_; }
  // Bytes of this rank's KV cache per token (all layers, its KV heads, keys and values).
  size_t KvBytesPerToken() const;

 private:
  void Embed(const kernels::Tensor& ids, kernels::Tensor* x) const;
  kernels::Tensor InputRows(const ForwardInput& in) const;
  kernels::Tensor LmHead(const kernels::Tensor& normed) const;
  // The bias of a row-parallel linear: added by rank 0 only, so the all-reduce adds it once.
  const kernels::Tensor* RowParallelBias(const kernels::Tensor& b) const {
    return b.defined() && layout_.rank == 0 ? &b : nullptr;
  }
  void Mlp(const LayerWeights& w, const kernels::Tensor& x, kernels::Tensor* out) const;
  // Rotary on q and k; with length-dependent frequencies, each sequence past the original
  // context gets its own.
  void Rotate(const ForwardInput& in, kernels::Tensor* q, kernels::Tensor* k) const;
  void Norm(const kernels::Tensor& x, const kernels::Tensor& w, const kernels::Tensor& b,
            kernels::Tensor* out) const;
  // x += y; out = Norm(x) (fused for RMSNorm).
  void AddNorm(kernels::Tensor* x, const kernels::Tensor& y, const kernels::Tensor& w,
               const kernels::Tensor& b, kernels::Tensor* out) const;
  // An activation buffer on the model's device.
  kernels::Tensor Buf(const kernels::Shape& shape) const;
  // A host index vector as a tensor on the model's device.
  kernels::Tensor Indices(const std::vector<int32_t>& v) const;

  DecoderSpec spec_;
  DecoderWeights w_;
  std::shared_ptr<Communicator> comm_;
  ShardLayout layout_;
  kernels::AttentionBias alibi_;  // this rank's heads' slopes
  kernels::Device device_ = kernels::Device::kCpu;
  kernels::DType act_dtype_ = kernels::DType::kF32;
};

// Checks shapes of `w` against `spec` split by `layout`; an error names the layer and the tensor.
absl::Status ValidateWeights(const DecoderSpec& spec, const ShardLayout& layout,
                             const DecoderWeights& w);

}  // namespace tgis::server

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
#include "kernels/tensor.h"
#include "server/communicator.h"
#include "server/lora.h"
#include "server/model.h"

namespace tgis::server {

// One rank's weights: shapes use the rank's local sizes (ShardLayout): Hq, Hk, I and V below
// are this rank's heads, KV heads, MLP columns and vocabulary rows.
struct LayerWeights {
  kernels::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // biases undefined for RMSNorm
  kernels::Tensor qkv_w, qkv_b;                // [(Hq + 2 Hk) * D, H]: q rows, then k, then v
  kernels::Tensor o_w, o_b;                    // [H, Hq * D]; the bias whole (added once)
  kernels::Tensor up_w, up_b;                  // [2I, H] ([gate | up]) or [I, H]
  kernels::Tensor down_w, down_b;              // [H, I]; the bias whole (added once)
  // Residual::kSandwich and kOutputNorms: the norms of the attention's and the MLP's outputs
  // (ln2 is the MLP's input norm in a sandwich; kOutputNorms has no ln1 or ln2).
  kernels::Tensor post_attn_norm_w, post_attn_norm_b, post_mlp_norm_w, post_mlp_norm_b;
  // DecoderSpec::qk_norms: [D] norms of each q head and each k head (one weight for all q
  // heads, one for all k heads), before rotary; qk_norms_whole: [Hq * D] and [Hk * D] of the
  // whole model (every rank's heads, not this rank's slice).
  kernels::Tensor q_norm_w, q_norm_b, k_norm_w, k_norm_b;
  // A mixture of experts (DecoderSpec::num_experts > 0) in place of up_w and down_w: the
  // router [E, H] (whole, as the checkpoint holds it) and each expert's [2I, H] ([gate | up])
  // and [H, I].
  // With a shared expert, router_w's last row is its gate: [E + 1, H].
  kernels::Tensor router_w;
  std::vector<kernels::Tensor> expert_up, expert_down;
  // GPT-OSS: the router's bias [E] and each expert's gate|up bias [2I] (this rank's columns,
  // as expert_up's rows) and down bias [H] (whole, added once); empty / undefined: none.
  kernels::Tensor router_b;
  std::vector<kernels::Tensor> expert_up_b, expert_down_b;
  // GPT-OSS's attention sinks of this rank's heads (kernels::AttentionBias::sinks), f32 on
  // the host; empty: none.
  std::vector<float> attn_sinks;
  kernels::Tensor shared_up, shared_down;  // [2S, H] and [H, S] (S: this rank's shared columns)
  // A Mamba-2 mixer (DecoderSpec::mamba_layers) in place of attention (qkv_w and o_w
  // undefined): in_proj [I + C + heads, H] (z | xBC | dt) and its bias, the depthwise
  // convolution [C, K] and its bias, dt_bias, a_log and d [heads], the gated norm [I], out_proj
  // [H, I] and its bias. All but the two projections in f32.
  kernels::Tensor mamba_in_w, mamba_in_b, conv_w, conv_b, dt_bias, a_log, ssm_d, mamba_norm_w;
  kernels::Tensor mamba_out_w, mamba_out_b;

  // The linear weights (undefined ones included), for what every linear gets alike.
  template <typename Self>
  static auto LinearsOf(Self& l) {
    std::vector<decltype(&l.qkv_w)> all = {&l.qkv_w,      &l.o_w,        &l.up_w,
                                           &l.down_w,     &l.shared_up,  &l.shared_down,
                                           &l.mamba_in_w, &l.mamba_out_w};
    for (auto* experts : {&l.expert_up, &l.expert_down}) {
      for (auto& t : *experts) all.push_back(&t);
    }
    return all;
  }
  std::vector<kernels::Tensor*> Linears() { return LinearsOf(*this); }
  std::vector<const kernels::Tensor*> Linears() const { return LinearsOf(*this); }
};

struct DecoderWeights {
  kernels::Tensor embed;                       // [V, E] (E: EmbedDim())
  kernels::Tensor embed_norm_w, embed_norm_b;  // [H] (embed_norm)
  kernels::Tensor project_in, project_out;     // [H, E] and [E, H] when E != H
  kernels::Tensor pos_embed;  // [P, H] learned positions (whole; row p is position p), or undefined
  std::vector<LayerWeights> layers;
  kernels::Tensor final_norm_w, final_norm_b;  // undefined: no final norm (post-norm layouts)
  kernels::Tensor lm_head;                     // [V, E]; may share storage with embed
  kernels::Tensor lm_head_b;                   // [V] (Phi), or undefined
};

// Shared layers of every family: the vocab-parallel token embedding (rows `layout.vocab` of
// the vocabulary on this rank; an all-reduce sums the ranks' lookups) and lm_head (this rank's
// logits, all-gathered: every rank returns all [rows, vocab] f32 logits).
void EmbedTokens(const kernels::Tensor& ids, const kernels::Tensor& embed,
                 const ShardLayout& layout, Communicator& comm, kernels::Tensor* x);
// Rows `rows` of x [T, H], in order: the rows whose logits a step wants (x itself when they are
// all of its rows in order, as in a decode step: no gather).
kernels::Tensor SelectRows(const kernels::Tensor& x, const std::vector<int32_t>& rows);
// Converts a weight to `dtype` and moves it to `device` (nothing for an undefined one).
void MoveWeight(kernels::Tensor* t, kernels::DType dtype, kernels::Device device);

// The KV cache's dtype for a model whose activations are `act` on `device` and whose linear
// weights are `linears`: the activations' on CUDA; on the CPU (f32 activations) a 16-bit
// model's own bf16 or f16, as transformers and llama.cpp keep it (half the memory, half the
// attention's reads; the CPU attention widens it in registers), and f32 for f32 weights and
// for models with any quantized linear (whose reference is transformers in f32 on the
// dequantized weights).
kernels::DType KvCacheDType(kernels::Device device, kernels::DType act,
                            const std::vector<const kernels::Tensor*>& linears);

// Prompt tuning: the rows of virtual tokens in the embedded input `x` take the prefix's vectors
// (ForwardInput::embedding_source / prefix_values; nothing when there are none).
void MixPrefixRows(const ForwardInput& in, kernels::Tensor* x);
// `lm_head_b`: this rank's rows of the lm_head's bias, or null.
kernels::Tensor VocabLogits(const kernels::Tensor& normed, const kernels::Tensor& lm_head,
                            const kernels::Tensor* lm_head_b, const ShardLayout& layout,
                            int64_t vocab, Communicator& comm);

class CausalLM : public Model {
 public:
  // `weights` hold the part of the model that `comm`'s rank owns (ShardLayout::Make of `spec`);
  // a null `comm` means world size 1.
  CausalLM(DecoderSpec spec, DecoderWeights weights, std::shared_ptr<Communicator> comm = nullptr);
  kernels::Tensor ForwardHidden(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                                const std::vector<int32_t>& logit_rows) const override;
  kernels::Tensor Logits(const kernels::Tensor& hidden) const override { return LmHead(hidden); }
  // On CUDA the activations and the KV cache take the linear weights' dtype, and every other
  // tensor (norms, biases) is converted to it too.
  void MoveTo(kernels::Device device) override;
  absl::StatusOr<std::shared_ptr<const LoraWeights>> MakeLora(
      const LoraAdapter& adapter) const override;
  kernels::Device device() const override { return device_; }
  kernels::DType act_dtype() const override { return act_dtype_; }
  kernels::DType kv_dtype() const override;
  const DecoderSpec& spec() const override { return spec_; }  // the whole model's sizes
  const ShardLayout& shard() const override { return layout_; }
  Communicator& communicator() const override { return *comm_; }
  size_t KvBytesPerToken() const override;

 private:
  void Embed(const kernels::Tensor& ids, kernels::Tensor* x) const;
  kernels::Tensor InputRows(const ForwardInput& in) const;
  kernels::Tensor LmHead(const kernels::Tensor& normed) const;
  // The bias of a row-parallel linear: added by rank 0 only, so the all-reduce adds it once.
  const kernels::Tensor* RowParallelBias(const kernels::Tensor& b) const {
    return b.defined() && layout_.rank == 0 ? &b : nullptr;
  }
  // A Mamba-2 layer's mixer (DecoderSpec::mamba_layers) of x (the layer's normed input) into
  // out [T, H].
  void MambaMixer(const ForwardInput& in, int64_t layer, const kernels::Tensor& x,
                  kernels::Tensor* out) const;
  void Mlp(const ForwardInput& in, int64_t layer, const kernels::Tensor& x,
           kernels::Tensor* out) const;
  // A dense MLP of `inter` columns (this rank's): up (gate | up for a gated one), activation,
  // down; with `in`, the step's LoRA deltas of layer `layer`'s MLP added.
  void DenseMlp(const kernels::Tensor& up_w, const kernels::Tensor& up_b,
                const kernels::Tensor& down_w, const kernels::Tensor& down_b, int64_t inter,
                const kernels::Tensor& x, kernels::Tensor* out, const ForwardInput* in = nullptr,
                int64_t layer = 0) const;
  // y += each LoRA adapter's delta of one linear (LoraLayer::*which of layer `layer`) for the
  // step's rows that take the adapter (ForwardInput::lora); x is the linear's input.
  void AddLora(const ForwardInput& in, int64_t layer, LoraPair LoraLayer::*which,
               const kernels::Tensor& x, kernels::Tensor* y) const;
  // The mixture of experts: the router's scores cross to the host (one synchronisation a layer
  // on CUDA, so these models run decode steps without CUDA graphs), each expert runs over the
  // rows routed to it, and their weighted outputs are summed into *out.
  void MixtureOfExperts(const LayerWeights& w, const kernels::Tensor& x,
                        kernels::Tensor* out) const;
  // Rotary with length-dependent frequencies on q and k: each sequence past the original
  // context gets its own (the other rotary models rotate inside QkvToCache).
  void Rotate(const ForwardInput& in, kernels::Tensor* q, kernels::Tensor* k) const;
  // DecoderSpec::qk_norms: this rank's q and k heads in qkv [T, (Hq + 2 Hk) * D] normed in place
  // (qk_norms_whole: over the whole projections).
  void NormHeads(const LayerWeights& w, kernels::Tensor* qkv) const;
  // [T, world * W] from each rank's [T, W]: rank r's columns at r * W (ranks hold consecutive
  // heads in rank order, so the rows are the whole projection's). A collective.
  kernels::Tensor ColumnsOfEveryRank(const kernels::Tensor& mine) const;
  void Norm(const kernels::Tensor& x, const kernels::Tensor& w, const kernels::Tensor& b,
            kernels::Tensor* out) const;
  // x += y; out = Norm(x) (fused for RMSNorm).
  void AddNorm(kernels::Tensor* x, const kernels::Tensor& y, const kernels::Tensor& w,
               const kernels::Tensor& b, kernels::Tensor* out) const;
  // An activation buffer on the model's device.
  kernels::Tensor Buf(const kernels::Shape& shape) const;

  DecoderSpec spec_;
  DecoderWeights w_;
  std::shared_ptr<Communicator> comm_;
  ShardLayout layout_;
  // This rank's heads' ALiBi slopes and the soft cap; attn_bias_used_: whether either is set.
  kernels::AttentionBias attn_bias_;
  bool attn_bias_used_ = false;
  // Where layers have their own attention sinks (GPT-OSS): per layer, attn_bias_ with them,
  // built once at load; else empty. AttentionBiasOf(l) says which a layer's attention takes.
  std::vector<kernels::AttentionBias> layer_attn_bias_;
  const kernels::AttentionBias* AttentionBiasOf(int64_t layer) const;
  kernels::Device device_ = kernels::Device::kCpu;
  kernels::DType act_dtype_ = kernels::DType::kF32;
};

// Checks shapes of `w` against `spec` split by `layout`; an error names the layer and the tensor.
absl::Status ValidateWeights(const DecoderSpec& spec, const ShardLayout& layout,
                             const DecoderWeights& w);

}  // namespace tgis::server

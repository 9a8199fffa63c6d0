// A decoder-only transformer assembled from shared layers. Architectures differ only in a
// DecoderSpec (norms, MLP kind, positions, residual layout) and in how their checkpoint names
// map onto DecoderWeights; each architecture's file under models/ does that mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::server {

enum class NormKind { kRms, kLayer };
enum class MlpKind {
  kGatedSilu,  // down(silu(gate(x)) * up(x)); up_w holds [gate | up]
  kPlain,      // proj(act(fc(x)))
};
enum class PositionKind { kRotary, kLearned, kAlibi };

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
  kernels::GeluKind gelu = kernels::GeluKind::kTanh;
  PositionKind position = PositionKind::kRotary;
  kernels::RotaryConfig rotary;
  bool parallel_residual = false;  // x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)
  int sliding_window = 0;
  float attn_scale = 0;  // 0: 1/sqrt(head_dim)
};

struct LayerWeights {
  kernels::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // biases undefined for RMSNorm
  kernels::Tensor qkv_w, qkv_b;                // [(Hq + 2 Hk) * D, H]: q rows, then k, then v
  kernels::Tensor o_w, o_b;
  kernels::Tensor up_w, up_b;
  kernels::Tensor down_w, down_b;
};

struct DecoderWeights {
  kernels::Tensor embed;      // [V, H]
  kernels::Tensor pos_embed;  // [P, H] learned positions, or undefined
  std::vector<LayerWeights> layers;
  kernels::Tensor final_norm_w, final_norm_b;
  kernels::Tensor lm_head;  // [V, H]; may share storage with embed
};

// One step's ragged batch.
struct ForwardInput {
  kernels::Tensor input_ids;     // [T] i32
  kernels::Tensor positions;     // [T] i32
  kernels::Tensor slot_mapping;  // [T] i32
  kernels::AttentionBatch attn;
};

class CausalLM {
 public:
  CausalLM(DecoderSpec spec, DecoderWeights weights);
  // Runs the batch, writing its keys/values into `cache` (one entry per layer), and returns
  // the logits [rows, V] of the token rows listed in `logit_rows`.
  kernels::Tensor Forward(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                          const std::vector<int32_t>& logit_rows) const;
  const DecoderSpec& spec() const { return spec_; }
  // Bytes of KV cache per token (all layers, keys and values, f32).
  size_t KvBytesPerToken() const;

 private:
  void Mlp(const LayerWeights& w, const kernels::Tensor& x, kernels::Tensor* out) const;
  void Norm(const kernels::Tensor& x, const kernels::Tensor& w, const kernels::Tensor& b,
            kernels::Tensor* out) const;

  DecoderSpec spec_;
  DecoderWeights w_;
  std::vector<float> alibi_;
};

// Checks shapes of `w` against `spec`; an error names the layer and the tensor.
absl::Status ValidateWeights(const DecoderSpec& spec, const DecoderWeights& w);

}  // namespace tgis::server

// Load-time reshaping of checkpoint tensors into the layouts DecoderWeights expects, and the
// tensor-parallel slicing every architecture shares (ShardedLoader).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/decoder_model.h"
#include "server/model_config.h"
#include "server/weights.h"

namespace tgis::server {

// The sizes every family starts from: hidden, layers, heads, vocabulary from the config, as
// many KV heads as heads and head_dim hidden / heads; families override what differs.
DecoderSpec MultiHeadSpec(const ModelConfig& c);

// Checkpoint tensors and where each goes once loaded (AssignLoads).
using TensorLoads = std::vector<std::pair<kernels::Tensor*, absl::StatusOr<kernels::Tensor>>>;

// Stacks 2-D tensors (same column count and dtype) or 1-D tensors along dim 0; quantized
// weights must share their column layout (the same bits and g_idx). Parts that differ so (or
// mix quantized and dense ones) are stacked dense in `dense_dtype` where given, else the error
// names `what`.
absl::StatusOr<kernels::Tensor> ConcatRows(const std::vector<kernels::Tensor>& parts,
                                           const std::string& what = "",
                                           std::optional<kernels::DType> dense_dtype = {});
// transformers' ACT2FN names: "gelu" -> erf GELU; "gelu_new", "gelu_pytorch_tanh", "gelu_fast"
// -> tanh GELU; "relu"; "silu", "swish". Others fail naming config.json's key `key` and the
// value.
absl::StatusOr<kernels::Activation> ActivationFromName(const std::string& act,
                                                       const std::string& key);

// How a checkpoint fuses q, k and v into one projection.
enum class QkvLayout {
  kConcat,   // all q rows, then all k rows, then all v rows (GPT-2, BigCode multi-query)
  kPerHead,  // [q(D) k(D) v(D)] for head 0, then head 1, ... (GPT-NeoX, BigCode MHA)
  kGrouped,  // per KV head: its group's q heads, then k, then v (Falcon's new architecture)
};

// Loads checkpoint tensors, or this rank's slice of them (ShardLayout), reading only that slice
// from the mapped safetensors. Linear weights come out [out, in] (`conv1d`: the checkpoint
// stores them [in, out], as GPT-2's Conv1D does) in the run dtype; 1-D tensors (biases, norms)
// and Whole() tensors in f32. At world size 1 an unsliced weight in the run dtype is a view of
// the mapped file (no copy).
class ShardedLoader {
 public:
  ShardedLoader(const WeightStore& weights, const DecoderSpec& spec, const ShardLayout& layout,
                kernels::DType dtype)
      : w_(weights), spec_(spec), layout_(layout), dtype_(dtype) {}

  const ShardLayout& layout() const { return layout_; }
  const DecoderSpec& spec() const { return spec_; }
  // A loader whose tensors are expert `expert`'s [rows, columns] of the checkpoint's 3-D
  // [experts, rows, columns] ones (GraniteMoE's input_linear and output_linear) or its [n] of
  // [experts, n] ones (GPT-OSS's biases), sliced as this one slices. Such tensors are read
  // dense, or as MXFP4 codes (GPT-OSS's); no other quantized form is served.
  ShardedLoader Expert(int64_t expert) const {
    ShardedLoader l = *this;
    l.expert_ = expert;
    return l;
  }
  // This rank's rows of q/k/v projections laid out head by head, and of the MLP.
  Range q_rows() const { return layout_.q_rows(spec_.head_dim); }
  Range kv_rows() const { return layout_.kv_rows(spec_.head_dim); }
  Range mlp_rows() const { return layout_.intermediate; }

  // Replicated tensors, whole, f32: norms, biases of row-parallel linears, learned positions.
  absl::StatusOr<kernels::Tensor> Whole(const std::string& name, bool conv1d = false) const;
  // A replicated tensor of any rank, whole, f32, that must have `shape` (transformers'
  // depthwise Conv1d weights, [channels, 1, kernel]).
  absl::StatusOr<kernels::Tensor> WholeShaped(const std::string& name,
                                              const kernels::Shape& shape) const;
  // Column-parallel: rows `ranges` of the output dimension, concatenated in order.
  absl::StatusOr<kernels::Tensor> OutputRows(const std::string& name,
                                             const std::vector<Range>& ranges,
                                             bool conv1d = false) const;
  // Column-parallel parts of several tensors stacked: q|k|v from q/k/v_proj, gate|up.
  absl::StatusOr<kernels::Tensor> StackOutputRows(
      const std::vector<std::pair<std::string, Range>>& parts, bool conv1d = false) const;
  // Row-parallel: columns `range` of the input dimension.
  absl::StatusOr<kernels::Tensor> InputColumns(const std::string& name, Range range,
                                               bool conv1d = false) const;
  // Vocab-parallel: this rank's rows of an embedding or lm_head [V, H].
  absl::StatusOr<kernels::Tensor> VocabRows(const std::string& name) const;
  // This rank's rows of the lm_head `name` as the checkpoint stores it: quantized (GPTQ with
  // lm_head = true; compressed-tensors or fp8 whose ignore list leaves the head out), else
  // VocabRows.
  absl::StatusOr<kernels::Tensor> HeadRows(const std::string& name) const;
  // Whether the checkpoint holds linear weight `name` in any form: dense, or the tensors of a
  // quantized linear (GPTQ/AWQ's qweight, compressed-tensors' weight_packed).
  bool Stores(const std::string& name) const;
  // Whether expert weight `name` is stored MXFP4 (name_blocks, name_scales): [out, in] then,
  // where transformers' dense parameter is [in, out] (conv1d), and loaded as 4-bit codes.
  bool StoresMxfp4(const std::string& name) const;
  // The lm_head as the quantization method serves it: int8 (or 4 bits) at load under
  // bitsandbytes (TGIS quantizes the head then, never the embedding), else as loaded
  // (HeadRows: dense, or as the checkpoint quantized it).
  absl::StatusOr<kernels::Tensor> LmHead(const std::string& name,
                                         const kernels::Tensor& rows) const {
    return MaybeQuantizeAtLoad(name, rows);
  }
  // This rank's q|k|v rows (weight or bias) of a fused projection: its q heads and its KV heads
  // (a KV head shared by several ranks is loaded by each of them).
  absl::StatusOr<kernels::Tensor> FusedQkv(const std::string& name, QkvLayout layout,
                                           bool conv1d = false) const;

 private:
  absl::StatusOr<kernels::Tensor> Raw(const std::string& name) const;
  // The quantized form of linear weight `name` (rows and columns of it), or nullopt when the
  // weight is stored dense and not to be quantized at load.
  std::optional<absl::StatusOr<kernels::Tensor>> Quantized(const std::string& name,
                                                           const std::vector<Range>& rows,
                                                           std::optional<Range> range) const;
  // Int8 or 4 bits at load (--quantize bitsandbytes, bitsandbytes-nf4/-fp4) of a dense linear
  // weight just read (the result as is otherwise); `whole`, when `dense` is columns `cols` of
  // it, gives the rows' scales (TP-invariant quantization). `name` (the checkpoint's tensor)
  // for errors.
  absl::StatusOr<kernels::Tensor> MaybeQuantizeAtLoad(const std::string& name,
                                                      absl::StatusOr<kernels::Tensor> dense,
                                                      const kernels::Tensor* whole = nullptr,
                                                      std::optional<Range> cols = {}) const;

  const WeightStore& w_;
  const DecoderSpec& spec_;
  ShardLayout layout_;
  kernels::DType dtype_;
  std::optional<int64_t> expert_;  // Expert()
};

// Stores each loaded tensor in its destination, or returns the first load's error.
absl::Status AssignLoads(TensorLoads* loads);

// The common end of every builder: the lm_head (this rank's rows of `head_name`, or the
// embedding when `tied` or the checkpoint has no such tensor), the shape checks, the model.
absl::StatusOr<std::unique_ptr<CausalLM>> FinishDecoder(const ShardedLoader& loader,
                                                        const WeightStore& weights,
                                                        const std::string& head_name, bool tied,
                                                        DecoderSpec spec, DecoderWeights dw,
                                                        std::shared_ptr<Communicator> comm);

}  // namespace tgis::server

// LoRA adapters (PEFT's "LORA" peft_type) served beside the base model, chosen per request: a
// request that names an adapter gets y = W x + scale * B (A x) from every linear the adapter
// adapts, while the other requests of the same batch get W x alone (the rows of each adapter
// are gathered, multiplied by its A and B, and added back: no merged copy of the weights).
//
// An adapter is a folder as PEFT's save_pretrained writes it: adapter_config.json and
// adapter_model.safetensors (or adapter_model.bin, with safe_serialization=False; tensors
// `base_model.model.<module>.lora_A.weight` [r, in] and
// `.lora_B.weight` [out, r]). What we do not serve is refused by name when the adapter loads,
// never ignored: DoRA, biases, modules_to_save, per-module ranks or alphas, layers_to_transform,
// embeddings or the lm_head as targets, and modules the model does not have.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "server/model.h"

namespace tgis::server {

// One adapted linear of one rank: delta = scale * (x a^T) b^T. a: [R, in] (a row-parallel
// linear's: this rank's input columns), b: [out, R] (a column-parallel linear's: this rank's
// output rows). A fused linear (q|k|v, gate|up) stacks its parts' A's and holds their B's
// block-diagonally. Undefined: not adapted.
struct LoraPair {
  kernels::Tensor a, b;
  bool defined() const { return a.defined(); }
};

struct LoraLayer {
  LoraPair qkv, o, up, down;
};

// An adapter made for one rank of one model, in its activation dtype, on its device.
struct LoraWeights {
  float scale = 1;  // lora_alpha / r (use_rslora: / sqrt(r))
  std::vector<LoraLayer> layers;
  size_t bytes() const;
};

// An adapter folder read and checked against what we serve: its modules (PEFT's paths, e.g.
// "model.layers.0.self_attn.q_proj") with their A [r, in] and B [out, r] in f32.
struct LoraAdapter {
  std::string name;  // what errors call it (the adapter's id: clients see these messages)
  float scale = 1;
  int64_t rank = 0;
  std::map<std::string, std::pair<kernels::Tensor, kernels::Tensor>> modules;
};

// adapter_config.json of `dir` when it says peft_type "LORA"; nullopt when the folder holds no
// LoRA adapter (a prompt-tuning prefix, or nothing).
std::optional<nlohmann::json> LoraAdapterConfig(const std::filesystem::path& dir);
// `name` stands for `dir` in error messages (a request's adapter id: no server path reaches
// a client). `config`: LoraAdapterConfig's, when already read.
absl::StatusOr<LoraAdapter> ReadLoraAdapter(const std::filesystem::path& dir,
                                            const std::string& name);
absl::StatusOr<LoraAdapter> ReadLoraAdapter(const std::filesystem::path& dir,
                                            const std::string& name, const nlohmann::json& config);

// The adapter's deltas for the part of the model `layout` gives this rank; an adapter whose
// modules, ranks or shapes do not fit the model (spec.lora_targets) fails naming them.
absl::StatusOr<std::shared_ptr<const LoraWeights>> MakeLoraWeights(const LoraAdapter& adapter,
                                                                   const DecoderSpec& spec,
                                                                   const ShardLayout& layout,
                                                                   kernels::DType dtype,
                                                                   kernels::Device device);

}  // namespace tgis::server

// Prompt-tuning prefixes, as TGIS's shards keep them (its prompt_cache.py): vectors loaded from
// PREFIX_STORE_PATH/<prefix id>/ on first use and kept in an LRU cache bounded in MiB. A prefix
// folder holds decoder.pt (what torch.save wrote: one [virtual tokens, hidden] tensor), or is a
// PEFT adapter (adapter_model.safetensors, else adapter_model.bin, holding
// {"prompt_embeddings": tensor}). For an encoder-decoder model it holds encoder.pt and/or
// decoder.pt, each of even length (no PEFT adapters).
//
// Error messages are TGIS's, word for word, as a TGIS router shows them to clients: a prefix
// that is not there is NOT_FOUND `prefix id "<id>" not found`; anything else wrong is UNKNOWN
// and reads as gRPC Python reports TGIS's exception ("Unexpected <class 'Exception'>: ...").
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "common/lru_cache.h"
#include "kernels/tensor.h"
#include "server/lora.h"

namespace tgis::server {

struct PrefixStoreOptions {
  std::string store_path;  // PREFIX_STORE_PATH; empty: prompt tuning is off
  double cache_mb = 512;   // PROMPT_CACHE_SIZE_MB
  int64_t hidden = 0;      // the model's embedding width
  int64_t max_length = 0;  // the most virtual tokens (the model's positions; 0: no limit)
  kernels::DType dtype = kernels::DType::kF32;
  kernels::Device device = kernels::Device::kCpu;
  bool encoder_decoder = false;
  // The model LoRA adapters are made for (Model::MakeLora); null: none are served.
  const Model* model = nullptr;
};

// A prefix's vectors [virtual tokens, hidden] in the model's dtype, on its device: before the
// decoder's tokens (decoder-only: always there) and, for encoder-decoder models, before the
// encoder's input (either may be missing there, not both).
struct Prefix {
  std::shared_ptr<const kernels::Tensor> decoder;
  std::shared_ptr<const kernels::Tensor> encoder;
  // A LoRA adapter (lora.h) in place of virtual tokens: a folder whose adapter_config.json says
  // peft_type "LORA" (decoder and encoder are then null, and the length 0).
  std::shared_ptr<const LoraWeights> lora;
  // TGIS's PrefixLookup length: the rows of both, the decoder's counted with the decoder start
  // token TGIS appends to it for encoder-decoder models.
  int64_t length(bool encoder_decoder) const;
};

class PrefixStore {
 public:
  explicit PrefixStore(PrefixStoreOptions options)
      : options_(std::move(options)), cache_(options_.cache_mb) {}

  // The prefix: from the cache, else loaded (and cached, evicting the least recently used ones
  // to stay in budget).
  absl::StatusOr<Prefix> Get(const std::string& prefix_id);

  size_t size() const;

 private:
  absl::StatusOr<Prefix> Load(const std::string& prefix_id) const;
  // A .pt file of the folder as a processed tensor; null when the file is not there.
  absl::StatusOr<std::shared_ptr<const kernels::Tensor>> LoadPt(const std::string& file) const;
  absl::StatusOr<kernels::Tensor> Process(const kernels::Tensor& prefix,
                                          const std::string& source_dtype) const;

  const PrefixStoreOptions options_;
  mutable std::mutex mu_;
  LruCache<Prefix> cache_;  // each prefix's cost: its MiB
};

}  // namespace tgis::server

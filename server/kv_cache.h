// The paged KV cache: per layer, [num_blocks, block_size, kv_heads, head_dim] keys and values,
// and an allocator of block indices shared by all layers.
#pragma once

#include <optional>
#include <vector>

#include "kernels/ops.h"

namespace tgis::server {

class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);
  std::optional<int32_t> Allocate();
  void Free(int32_t block);
  int free_count() const { return static_cast<int>(free_.size()); }
  int total() const { return total_; }

 private:
  std::vector<int32_t> free_;
  int total_;
};

class KvCache {
 public:
  // Keys and values in `dtype` on `device` (the model's activations').
  KvCache(int num_layers, int num_blocks, int block_size, int kv_heads, int head_dim,
          kernels::DType dtype = kernels::DType::kF32,
          kernels::Device device = kernels::Device::kCpu);
  std::vector<kernels::KvCacheLayer>* layers() { return &layers_; }
  BlockAllocator& allocator() { return allocator_; }
  int block_size() const { return block_size_; }
  int num_blocks() const { return allocator_.total(); }

 private:
  std::vector<kernels::KvCacheLayer> layers_;
  BlockAllocator allocator_;
  int block_size_;
};

}  // namespace tgis::server

// The paged KV cache: per layer, [num_blocks, block_size, kv_heads, head_dim] keys and values,
// and the blocks' bookkeeping (BlockCache: allocation, sharing, prefix caching) for all layers.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "server/block_cache.h"

namespace tgis::server {

class KvCache {
 public:
  // Keys and values in `dtype` on `device` (Model::kv_dtype). `prefix_caching`: full
  // blocks are kept and shared by content (BlockCache). Layers flagged in `no_attention`
  // (Mamba-2 mixers: DecoderSpec::mamba_layers) get none.
  KvCache(int num_layers, int num_blocks, int block_size, int kv_heads, int head_dim,
          kernels::DType dtype = kernels::DType::kF32,
          kernels::Device device = kernels::Device::kCpu, bool prefix_caching = false,
          const std::vector<bool>& no_attention = {});
  std::vector<kernels::KvCacheLayer>* layers() { return &layers_; }
  BlockCache& blocks() { return blocks_; }
  int block_size() const { return blocks_.block_size(); }
  int num_blocks() const { return blocks_.total(); }

 private:
  std::vector<kernels::KvCacheLayer> layers_;
  BlockCache blocks_;
};

}  // namespace tgis::server

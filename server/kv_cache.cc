#include "server/kv_cache.h"

namespace tgis::server {

BlockAllocator::BlockAllocator(int num_blocks) : total_(num_blocks) {
  free_.reserve(num_blocks);
  // Hand out low block numbers first (pop from the back).
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

std::optional<int32_t> BlockAllocator::Allocate() {
  if (free_.empty()) return std::nullopt;
  int32_t b = free_.back();
  free_.pop_back();
  return b;
}

void BlockAllocator::Free(int32_t block) { free_.push_back(block); }

KvCache::KvCache(int num_layers, int num_blocks, int block_size, int kv_heads, int head_dim,
                 kernels::DType dtype, kernels::Device device)
    : allocator_(num_blocks), block_size_(block_size) {
  layers_.reserve(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    kernels::Shape shape = {num_blocks, block_size, kv_heads, head_dim};
    layers_.push_back(kernels::KvCacheLayer{kernels::Tensor::Zeros(shape, dtype, device),
                                            kernels::Tensor::Zeros(shape, dtype, device)});
  }
}

}  // namespace tgis::server

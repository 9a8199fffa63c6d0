#include "server/kv_cache.h"

namespace tgis::server {

KvCache::KvCache(int num_layers, int num_blocks, int block_size, int kv_heads, int head_dim,
                 kernels::DType dtype, kernels::Device device, bool prefix_caching)
    : blocks_(num_blocks, block_size, prefix_caching) {
  layers_.reserve(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    kernels::Shape shape = {num_blocks, block_size, kv_heads, head_dim};
    layers_.push_back(kernels::KvCacheLayer{kernels::Tensor::Zeros(shape, dtype, device),
                                            kernels::Tensor::Zeros(shape, dtype, device)});
  }
}

}  // namespace tgis::server

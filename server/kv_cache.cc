#include "server/kv_cache.h"

namespace tgis::server {

KvCache::KvCache(int num_layers, int num_blocks, int block_size, int kv_heads, int head_dim,
                 kernels::DType dtype, kernels::Device device, bool prefix_caching,
                 const std::vector<bool>& no_attention)
    : blocks_(num_blocks, block_size, prefix_caching) {
  layers_.reserve(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    if (static_cast<size_t>(l) < no_attention.size() && no_attention[static_cast<size_t>(l)]) {
      layers_.emplace_back();  // a layer without attention keeps no keys or values
      continue;
    }
    kernels::Shape shape = {num_blocks, block_size, kv_heads, head_dim};
    layers_.push_back(kernels::KvCacheLayer{kernels::Tensor::Zeros(shape, dtype, device),
                                            kernels::Tensor::Zeros(shape, dtype, device)});
  }
}

}  // namespace tgis::server

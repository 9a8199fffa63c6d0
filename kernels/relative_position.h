// T5's relative position buckets (transformers' T5Attention._relative_position_bucket), shared
// by the CPU and CUDA attention kernels: exact for small distances, logarithmic up to
// max_distance, split by sign when bidirectional (encoders), past keys only otherwise.
#pragma once

#include <cmath>

#ifdef __CUDACC__
#define TGIS_HOST_DEVICE __host__ __device__
#else
#define TGIS_HOST_DEVICE
#endif

namespace tgis::kernels {

// `relative` is key position - query position. The large-distance branch follows torch's f32
// arithmetic: log(rel / max_exact) / log(max_distance / max_exact) * (buckets - max_exact),
// truncated toward zero.
TGIS_HOST_DEVICE inline int RelativePositionBucket(int relative, bool bidirectional,
                                                   int num_buckets, int max_distance) {
  int bucket = 0;
  int n = num_buckets;
  if (bidirectional) {
    n /= 2;
    if (relative > 0) bucket += n;
    relative = relative < 0 ? -relative : relative;
  } else {
    relative = relative < 0 ? -relative : 0;
  }
  const int max_exact = n / 2;
  if (relative < max_exact) return bucket + relative;
  const float ratio = static_cast<float>(relative) / static_cast<float>(max_exact);
  const float span = static_cast<float>(log(static_cast<double>(max_distance) / max_exact));
  const int large =
      max_exact + static_cast<int>(logf(ratio) / span * static_cast<float>(n - max_exact));
  return bucket + (large < n - 1 ? large : n - 1);
}

}  // namespace tgis::kernels

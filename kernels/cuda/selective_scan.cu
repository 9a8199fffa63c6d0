// SelectiveScan (ops.h) on CUDA: checks, and the two launches of selective_scan.cuh's kernels
// per batch of sequences.
#include <algorithm>

#include "kernels/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/selective_scan.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

namespace {

void CheckF32(const Tensor& t, const char* what) {
  TGIS_CHECK(t.defined() && t.device() == Device::kCuda && t.dtype() == DType::kF32,
             "SelectiveScan: %s must be a CUDA f32 tensor", what);
}

}  // namespace

void SelectiveScan(const SsmConfig& cfg, const Tensor& proj, const Tensor& conv_w,
                   const Tensor& conv_b, const Tensor& dt_bias, const Tensor& a_log,
                   const Tensor& d, const std::vector<int32_t>& query_start,
                   const std::vector<Tensor*>& conv_states, const std::vector<Tensor*>& ssm_states,
                   const std::vector<uint8_t>& fresh, Tensor* out) {
  const char* op = "SelectiveScan";
  ScanSizes sz{cfg.heads, cfg.head_dim, cfg.groups, cfg.state_size, cfg.conv_kernel, 0, 0, 0};
  sz.inner = sz.heads * sz.p;
  sz.channels = sz.inner + 2 * sz.groups * sz.n;
  sz.width = sz.inner + sz.channels + sz.heads;
  const size_t seqs = query_start.size() - 1;  // shapes checked by kernels::SelectiveScan
  CheckCudaFloat(proj, op, "proj");
  CheckCudaFloat(*out, op, "out");
  CheckF32(conv_w, "conv_w");
  CheckF32(dt_bias, "dt_bias");
  CheckF32(a_log, "a_log");
  CheckF32(d, "d");
  if (conv_b.defined()) CheckF32(conv_b, "conv_b");
  const int64_t rows = proj.dim(0);
  if (rows == 0) return;
  Tensor xbc = Tensor::Empty({rows, sz.channels}, DType::kF32, Device::kCuda);
  const float* bias = conv_b.defined() ? conv_b.data<float>() : nullptr;
  const int conv_threads = 128;
  const unsigned channel_blocks = Blocks(sz.channels, conv_threads);
  const int scan_threads = RowThreads(sz.p);
  for (size_t first = 0; first < seqs; first += kScanBatch) {
    const size_t count = std::min<size_t>(kScanBatch, seqs - first);
    ScanBatch batch{};
    for (size_t i = 0; i < count; ++i) {
      const size_t s = first + i;
      batch.seq[i] = {conv_states[s]->data<float>(), ssm_states[s]->data<float>(), query_start[s],
                      query_start[s + 1], fresh[s] ? 1 : 0};
    }
    TGIS_DISPATCH_FLOAT(
        proj.dtype(), op,
        Launch(ConvKernel<T>, dim3(static_cast<unsigned>(count), channel_blocks), conv_threads,
               batch, sz, proj.data<T>(), conv_w.data<float>(), bias, xbc.data<float>(),
               out->data<T>());
        Launch(ScanKernel<T>, dim3(static_cast<unsigned>(count), static_cast<unsigned>(sz.heads)),
               scan_threads, batch, sz, proj.data<T>(), xbc.data<float>(), dt_bias.data<float>(),
               a_log.data<float>(), d.data<float>(), out->data<T>()));
  }
}

}  // namespace tgis::kernels::cuda

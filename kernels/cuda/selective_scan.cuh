// Internal: the kernels of SelectiveScan (ops.h) on CUDA, in the CPU kernel's order of
// operations: the causal convolution first (one thread a channel of a sequence, over its
// tokens), then the recurrence (one block a (sequence, head), one thread a row of the head's
// [head_dim, N] state, over the tokens). Any kernel size and head width: the convolution's past
// inputs stay in the sequence's slot, and rows past the block's width go round it again. The
// sequences' states and rows travel in the launch's parameters (ScanBatch), a batch of them at
// a time: nothing is copied from the host, so no step waits on it.
//
// Like the attention kernels, it needs its includer to provide the CUDA keywords and primitives
// (common.cuh in the build, tests/unit/warp_emulator.h in the test that runs it on the CPU).
#pragma once

#include <cstdint>

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host.
namespace {

// Sequences per launch: their descriptors (32 bytes each) fit the 4 KiB of kernel parameters.
constexpr int kScanBatch = 64;

struct ScanSequence {
  float* conv;  // [C, K - 1], oldest first
  float* ssm;   // [heads, P, N]
  int32_t begin, end;
  int32_t fresh;
};

struct ScanBatch {
  ScanSequence seq[kScanBatch];
};

struct ScanSizes {
  int64_t heads, p, groups, n, k, inner, channels, width;
};

// torch.nn.functional.softplus (beta 1, threshold 20), as the CPU kernel.
__device__ __forceinline__ float Softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float Silu(float x) { return x / (1.0f + expf(-x)); }

// xBC = silu(conv(xBC) + bias) of every row into xbc [T, C] (f32), z copied into out's first
// half. Grid: (sequences, channel blocks).
template <typename T>
__global__ void ConvKernel(ScanBatch batch, ScanSizes sz, const T* proj, const float* w,
                           const float* bias, float* xbc, T* out) {
  PriorGridsDone();
  const ScanSequence s = batch.seq[blockIdx.x];
  const int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= sz.channels) return;  // channels > inner: z's columns are among them
  const int64_t k = sz.k;
  // The past K - 1 inputs stay in the slot, oldest first, as the CPU kernel keeps them (any K).
  float* past = s.conv + c * (k - 1);
  if (s.fresh) {
    for (int64_t j = 0; j < k - 1; ++j) past[j] = 0.0f;
  }
  const float* wc = w + c * k;
  for (int32_t t = s.begin; t < s.end; ++t) {
    const float raw = ToF32(proj[t * sz.width + sz.inner + c]);
    float acc = 0;
    for (int64_t j = 0; j < k - 1; ++j) acc += wc[j] * past[j];
    acc += wc[k - 1] * raw;
    if (bias != nullptr) acc += bias[c];
    xbc[t * sz.channels + c] = Silu(acc);
    if (k > 1) {
      for (int64_t j = 0; j + 1 < k - 1; ++j) past[j] = past[j + 1];
      past[k - 2] = raw;
    }
  }
  if (c < sz.inner) {
    for (int32_t t = s.begin; t < s.end; ++t) {
      out[t * 2 * sz.inner + c] = proj[t * sz.width + c];
    }
  }
}

// The recurrence of head blockIdx.y of sequence blockIdx.x: thread i keeps row i of the head's
// state (N values, in the sequence's slot) and writes y[i] of every token. The read-out sums in
// the CPU kernel's 8 interleaved partial sums, added in its order.
template <typename T>
__global__ void ScanKernel(ScanBatch batch, ScanSizes sz, const T* proj, const float* xbc,
                           const float* dt_bias, const float* a_log, const float* d, T* out) {
  PriorGridsDone();
  const ScanSequence s = batch.seq[blockIdx.x];
  const int64_t h = blockIdx.y, n = sz.n;
  const int64_t g = h / (sz.heads / sz.groups);
  const float a = -expf(a_log[h]);
  // Rows past the block's width (head_dim over 1024) go round again.
  for (int64_t i = threadIdx.x; i < sz.p; i += blockDim.x) {
    float* state = s.ssm + (h * sz.p + i) * n;
    if (s.fresh) {
      for (int64_t j = 0; j < n; ++j) state[j] = 0.0f;
    }
    for (int32_t t = s.begin; t < s.end; ++t) {
      const float* x = xbc + t * sz.channels;
      const float* bg = x + sz.inner + g * n;
      const float* cg = x + sz.inner + sz.groups * n + g * n;
      const float dt =
          Softplus(ToF32(proj[t * sz.width + sz.inner + sz.channels + h]) + dt_bias[h]);
      const float decay = expf(dt * a);
      const float xi = x[h * sz.p + i];
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
          const float v = state[j + l] * decay + dt * bg[j + l] * xi;
          state[j + l] = v;
          part[l] += v * cg[j + l];
        }
      }
      for (; j < n; ++j) {
        const float v = state[j] * decay + dt * bg[j] * xi;
        state[j] = v;
        part[0] += v * cg[j];
      }
      const float acc =
          ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      out[t * 2 * sz.inner + sz.inner + h * sz.p + i] = FromF32<T>(acc + d[h] * xi);
    }
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

// The CUDA implementations of the ops in ops.h, and the device memory hooks Tensor uses.
// Declared always; defined only in builds with CUDA (TGIS_WITH_CUDA, by kernels/cuda/*.cu).
// All work goes on one stream in order; copies to or from the host return when done. The dispatcher
// in ops.cc calls these for Device::kCuda tensors.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cuda {

// Memory.
int DeviceCount();
void* Malloc(size_t nbytes);
void Free(void* p);
void Memset(void* p, int value, size_t nbytes);
// A synchronous copy between any two devices (host <-> device, device <-> device).
void Copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
// Selects this process's GPU; call before any other CUDA work.
void SetDevice(int index);
// The process's stream (a cudaStream_t), for libraries that queue work on it (NCCL).
void* NativeStream();
// Waits for everything queued on the process's stream.
void Synchronize();
// Free device memory in bytes (what the KV cache may take at Warmup).
size_t FreeMemory();

// Ops: same contracts as in ops.h.
void Embedding(const Tensor& ids, const Tensor& weight, Tensor* out);
void EmbeddingSlice(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out);
void CopyColumns(const Tensor& src, int64_t src_col, int64_t ncols, Tensor* dst, int64_t dst_col);
void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* out);
void RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor* out);
void LayerNorm(const Tensor& x, const Tensor& w, const Tensor* bias, float eps, Tensor* out);
void AddInPlace(Tensor* x, const Tensor& y);
void AddRmsNorm(Tensor* x, const Tensor& y, const Tensor& w, float eps, Tensor* out);
void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k);
void SiluMul(const Tensor& gate_up, Tensor* out);
void Gelu(GeluKind kind, Tensor* x);
void Softmax(Tensor* x);
void LogSoftmax(Tensor* x);
void GreedyPick(Tensor* logits, const Tensor& banned, Tensor* ids, Tensor* logprobs);
void ReshapeAndCache(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                     KvCacheLayer* cache);
void PagedAttention(const Tensor& q, const KvCacheLayer& cache, const AttentionBatch& batch,
                    float scale, int sliding_window, const std::vector<float>* alibi_slopes,
                    Tensor* out);

}  // namespace tgis::kernels::cuda

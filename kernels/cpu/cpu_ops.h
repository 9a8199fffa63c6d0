// Internal: the CPU implementations of the ops in ops.h (same contracts), called by the
// dispatcher in ops.cc, plus hooks for tests and benchmarks.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cpu {

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

// Which Linear code path runs: kAuto picks AVX2/FMA when the CPU has it. Tests force kScalar
// to cover the fallback; not thread-safe against concurrent Linear calls.
enum class Isa { kAuto, kScalar, kAvx2 };
void SetIsaForTesting(Isa isa);
// The path kAuto resolves to on this machine ("avx2+fma" or "scalar").
const char* ActiveIsaName();

}  // namespace tgis::kernels::cpu

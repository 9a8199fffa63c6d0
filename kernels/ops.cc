// The dispatcher: each op runs on the device of its tensors (all must agree).
#include "kernels/ops.h"

#include <atomic>
#include <cmath>

#include "kernels/check.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda_ops.h"
#include "kernels/quantized.h"

namespace tgis::kernels {

bool SetCpuInt8Activations(bool on) {
  if (on && !cpu::Int8ActivationsAvailable()) return false;
  cpu::SetInt8Activations(on);
  return true;
}

namespace {
std::atomic<size_t> g_released_code_bytes{0};
}

void PrepareCpuWeight(Tensor* w) {
  const QuantizedWeight* q = w->quantized();
  if (q == nullptr || w->device() != Device::kCpu || q->codes_only_in_panels) return;
  if (!cpu::PrepareQuantized(*q)) return;
  auto kept = std::make_shared<QuantizedWeight>(*q);
  kept->cpu_layout.ShareFrom(q->cpu_layout);
  // The panels hold the run constants too.
  kept->codes = Tensor::Zeros({q->out, 0}, DType::kI8);
  kept->scales = Tensor();
  kept->zeros = Tensor();
  kept->codes_only_in_panels = true;
  g_released_code_bytes += q->codes.nbytes() + q->scales.nbytes() + q->zeros.nbytes();
  *w = Tensor::Quantized(std::move(kept));
}

void ParallelTasks(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  cpu::ThreadPool::Global().Run(n, fn);
}

size_t CpuDerivedLayoutBytes() { return cpu::DerivedLayoutBytes(); }

size_t CpuReleasedCodeBytes() { return g_released_code_bytes.load(); }

int CpusAvailable() { return cpu::CpusAvailable(); }

bool SetCpuThreads(int n) { return cpu::SetGlobalPoolSize(n); }

std::string CpuBackendSummary() {
  return std::string("linear isa ") + cpu::ActiveIsaName() + ", " +
         std::to_string(cpu::ThreadPool::Global().size()) + " threads, prefill GEMM " +
         cpu::PrefillGemmName();
}

namespace {

// The device of the defined tensors among `ts`; they must all be on the same one.
Device DeviceOf(const char* op, std::initializer_list<const Tensor*> ts) {
  bool found = false;
  Device d = Device::kCpu;
  for (const Tensor* t : ts) {
    if (t == nullptr || !t->defined()) continue;
    if (!found) {
      d = t->device();
      found = true;
    } else {
      TGIS_CHECK(t->device() == d, "%s: tensors on different devices", op);
    }
  }
  return d;
}

}  // namespace

#ifdef TGIS_WITH_CUDA
#define TGIS_DISPATCH(op, tensors, ...)                                      \
  if (DeviceOf(#op, tensors) == Device::kCuda) return cuda::op(__VA_ARGS__); \
  return cpu::op(__VA_ARGS__)
#else
#define TGIS_DISPATCH(op, tensors, ...)                                                        \
  if (DeviceOf(#op, tensors) == Device::kCuda)                                                 \
    TGIS_FATAL("%s: got a CUDA tensor, but this build has no CUDA (configure with TGIS_CUDA)", \
               #op);                                                                           \
  return cpu::op(__VA_ARGS__)
#endif
#define TGIS_TENSORS(...) \
  { __VA_ARGS__ }

void Embedding(const Tensor& ids, const Tensor& weight, Tensor* out) {
  TGIS_DISPATCH(Embedding, TGIS_TENSORS(&ids, &weight, out), ids, weight, out);
}

void EmbeddingSlice(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out) {
  TGIS_DISPATCH(EmbeddingSlice, TGIS_TENSORS(&ids, &weight, out), ids, weight, first_id, out);
}

void CopyColumns(const Tensor& src, int64_t src_col, int64_t ncols, Tensor* dst, int64_t dst_col) {
  TGIS_DISPATCH(CopyColumns, TGIS_TENSORS(&src, dst), src, src_col, ncols, dst, dst_col);
}

void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* out) {
  TGIS_DISPATCH(Linear, TGIS_TENSORS(&x, &w, bias, out), x, w, bias, out);
}

void RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor* out) {
  TGIS_DISPATCH(RmsNorm, TGIS_TENSORS(&x, &w, out), x, w, eps, out);
}

void LayerNorm(const Tensor& x, const Tensor& w, const Tensor* bias, float eps, Tensor* out) {
  TGIS_DISPATCH(LayerNorm, TGIS_TENSORS(&x, &w, bias, out), x, w, bias, eps, out);
}

void AddInPlace(Tensor* x, const Tensor& y) {
  TGIS_DISPATCH(AddInPlace, TGIS_TENSORS(x, &y), x, y);
}

void AddRmsNorm(Tensor* x, const Tensor& y, const Tensor& w, float eps, Tensor* out) {
  TGIS_DISPATCH(AddRmsNorm, TGIS_TENSORS(x, &y, &w, out), x, y, w, eps, out);
}

void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k) {
  TGIS_DISPATCH(Rotary, TGIS_TENSORS(&positions, q, k), cfg, positions, q, k);
}

void GatedActivation(Activation kind, const Tensor& gate_up, Tensor* out) {
  TGIS_DISPATCH(GatedActivation, TGIS_TENSORS(&gate_up, out), kind, gate_up, out);
}

void ClampedSwiGlu(const Tensor& gate_up, float alpha, float limit, Tensor* out) {
  TGIS_DISPATCH(ClampedSwiGlu, TGIS_TENSORS(&gate_up, out), gate_up, alpha, limit, out);
}

void Activate(Activation kind, Tensor* x) { TGIS_DISPATCH(Activate, TGIS_TENSORS(x), kind, x); }
void Clamp(float lo, float hi, Tensor* x) { TGIS_DISPATCH(Clamp, TGIS_TENSORS(x), lo, hi, x); }
void Scale(float factor, Tensor* x) { TGIS_DISPATCH(Scale, TGIS_TENSORS(x), factor, x); }
void SoftCap(float cap, Tensor* x) {
  TGIS_CHECK(cap > 0 && std::isfinite(cap), "SoftCap: cap %g must be positive and finite",
             static_cast<double>(cap));
  TGIS_DISPATCH(SoftCap, TGIS_TENSORS(x), cap, x);
}
void AddWeightedRows(const Tensor& src, const Tensor& rows, const Tensor& weights, Tensor* out) {
  TGIS_DISPATCH(AddWeightedRows, TGIS_TENSORS(&src, &rows, &weights, out), src, rows, weights, out);
}

void SelectiveScan(const SsmConfig& cfg, const Tensor& proj, const Tensor& conv_w,
                   const Tensor& conv_b, const Tensor& dt_bias, const Tensor& a_log,
                   const Tensor& d, const std::vector<int32_t>& query_start,
                   const std::vector<Tensor*>& conv_states, const std::vector<Tensor*>& ssm_states,
                   const std::vector<uint8_t>& fresh, Tensor* out) {
  // The sizes every backend needs; each checks its own dtypes and device.
  const int64_t heads = cfg.heads, p = cfg.head_dim, groups = cfg.groups, n = cfg.state_size;
  const int64_t k = cfg.conv_kernel, inner = heads * p, channels = inner + 2 * groups * n;
  const int64_t width = inner + channels + heads;
  const size_t seqs = query_start.empty() ? 0 : query_start.size() - 1;
  TGIS_CHECK(heads > 0 && p > 0 && groups > 0 && n > 0 && k > 0 && heads % groups == 0,
             "SelectiveScan: bad sizes");
  TGIS_CHECK(out->dtype() == proj.dtype() && proj.rank() == 2 && proj.dim(1) == width &&
                 out->rank() == 2 && out->dim(1) == 2 * inner && out->dim(0) == proj.dim(0),
             "SelectiveScan: proj [T, %lld] and out [T, %lld] of one dtype expected",
             static_cast<long long>(width), static_cast<long long>(2 * inner));
  TGIS_CHECK(conv_w.numel() == channels * k && (!conv_b.defined() || conv_b.numel() == channels) &&
                 dt_bias.numel() == heads && a_log.numel() == heads && d.numel() == heads,
             "SelectiveScan: parameter shapes");
  TGIS_CHECK(conv_states.size() == seqs && ssm_states.size() == seqs && fresh.size() == seqs &&
                 (seqs == 0 ? proj.dim(0) == 0 : query_start.back() == proj.dim(0)),
             "SelectiveScan: one state per sequence, the sequences' rows proj's");
  for (size_t s = 0; s < seqs; ++s) {
    TGIS_CHECK(
        conv_states[s]->numel() == channels * (k - 1) && ssm_states[s]->numel() == heads * p * n &&
            conv_states[s]->dtype() == DType::kF32 && ssm_states[s]->dtype() == DType::kF32 &&
            conv_states[s]->device() == proj.device() && ssm_states[s]->device() == proj.device() &&
            query_start[s] <= query_start[s + 1],
        "SelectiveScan: state shapes (f32, on proj's device)");
  }
  if (seqs == 0) return;
  TGIS_DISPATCH(SelectiveScan, TGIS_TENSORS(&proj, &conv_w, &conv_b, &dt_bias, &a_log, &d, out),
                cfg, proj, conv_w, conv_b, dt_bias, a_log, d, query_start, conv_states, ssm_states,
                fresh, out);
}

void Softmax(Tensor* x) { TGIS_DISPATCH(Softmax, TGIS_TENSORS(x), x); }

void LogSoftmax(Tensor* x) { TGIS_DISPATCH(LogSoftmax, TGIS_TENSORS(x), x); }

void GreedyPick(Tensor* logits, const Tensor& banned, Tensor* ids, Tensor* logprobs) {
  TGIS_DISPATCH(GreedyPick, TGIS_TENSORS(logits, &banned, ids, logprobs), logits, banned, ids,
                logprobs);
}

void RepetitionPenalty(Tensor* logits, const Tensor& tokens, const Tensor& penalties) {
  TGIS_DISPATCH(RepetitionPenalty, TGIS_TENSORS(logits, &tokens, &penalties), logits, tokens,
                penalties);
}

void TopLogits(const Tensor& logits, const Tensor& rows, const Tensor& temperatures, int64_t count,
               Tensor* values, Tensor* ids, Tensor* stats) {
  TGIS_DISPATCH(TopLogits, TGIS_TENSORS(&logits, &rows, &temperatures, values, ids, stats), logits,
                rows, temperatures, count, values, ids, stats);
}

void ReshapeAndCache(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                     KvCacheLayer* cache) {
  TGIS_DISPATCH(ReshapeAndCache, TGIS_TENSORS(&k, &v, &slot_mapping, &cache->k, &cache->v), k, v,
                slot_mapping, cache);
}

void QkvToCache(const Tensor& qkv, const RotaryConfig* rotary, const Tensor& positions,
                const Tensor& slot_mapping, Tensor* q, KvCacheLayer* cache) {
  TGIS_DISPATCH(QkvToCache, TGIS_TENSORS(&qkv, &positions, &slot_mapping, q, &cache->k, &cache->v),
                qkv, rotary, positions, slot_mapping, q, cache);
}

void PagedAttention(const Tensor& q, const KvCacheLayer& cache, const AttentionBatch& batch,
                    float scale, int sliding_window, const AttentionBias* bias, Tensor* out) {
  const Tensor* table =
      bias != nullptr && bias->relative_table.defined() ? &bias->relative_table : &q;
  TGIS_CHECK(bias == nullptr || (bias->softcap >= 0 && std::isfinite(bias->softcap)),
             "PagedAttention: softcap %g must be 0 (none) or positive and finite",
             static_cast<double>(bias->softcap));
  TGIS_DISPATCH(PagedAttention,
                TGIS_TENSORS(&q, &cache.k, &cache.v, &batch.query_start, &batch.context_lens,
                             &batch.block_tables, table, out),
                q, cache, batch, scale, sliding_window, bias, out);
}

}  // namespace tgis::kernels

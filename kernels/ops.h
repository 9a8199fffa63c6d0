// The op set. Each op is declared once here and implemented per device (cpu/, cuda/); the
// dispatcher picks by the tensors' device. The CPU versions are the reference the CUDA ones
// are tested against.
//
// Conventions: activations are f32 on the CPU (bf16/f16 on CUDA); weights may be f32, bf16 or
// f16. Batches are ragged and never padded: T is the total number of tokens of all sequences
// in a step; per-sequence metadata describes how they split.
//
// Outputs (`Tensor* out`): an undefined tensor is allocated (f32 on the CPU, the activations'
// dtype on CUDA, on the inputs' device); a defined one (e.g. a view into a workspace) must already
// have the right shape, dtype and device and is written in place. Only RmsNorm and LayerNorm allow
// `out` to be the same tensor as `x` (in place); other outputs must not overlap their inputs.
// Integer index tensors (ids, positions, slot_mapping) may be i32 or i64.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace tgis::kernels {

// How the CPU kernels run on this machine, for a start-up log line: the Linear ISA path, the
// pool's threads and the OpenBLAS kernel family (this loads OpenBLAS: call it before other
// threads start, as it sets OpenBLAS's environment variables first).
std::string CpuBackendSummary();
// CPUs this process may use: its affinity mask capped by its cgroup's CPU quota (a container's
// limits.cpu).
int CpusAvailable();
// The CPU kernels' threads, set before their first use (false after); TGIS_CPU_THREADS, when
// set, wins. Default: CpusAvailable().
bool SetCpuThreads(int n);

// Runs fn(i) for every i in [0, n) on the kernels' CPU thread pool (the caller takes part) and
// returns when all are done: for the host's work between steps, such as choosing the tokens of
// a step's sampled sequences.
void ParallelTasks(int64_t n, const std::function<void(int64_t)>& fn);

// Opt-in CPU speed mode for 8- and 4-bit weights: prefill and decode multiply them by
// activations rounded to int8 per 32 columns (as llama.cpp and CTranslate2 do: outputs move by
// that rounding, no longer within 1e-4
// of transformers on the dequantized weights). Process-wide; false, changing nothing, when the
// CPU lacks AVX2 (AVX-512 VNNI is used where the CPU has it).
bool SetCpuInt8Activations(bool on);

// Makes now what the CPU kernels would otherwise derive from a Linear weight on its first use
// under the current settings (8- and 4-bit codes interleaved 8 rows at a time, for exact AVX2
// decode and, 4-bit, for int8 activations), so that the memory is taken at load, before the KV
// cache is sized from what is left. Where every kernel path for the weight then reads that
// layout (AVX2 without AVX-512; 8-bit codes with int8 activations off), *w is replaced by a copy of
// the weight that keeps its codes there only: the row-major copy is let go (it is freed once no
// other tensor holds it). Nothing for other weights, devices or settings. Call it once per weight,
// after the settings (the ISA, int8 activations) are final.
void PrepareCpuWeight(Tensor* w);
// Bytes the CPU kernels' derived layouts hold now, and those of the row-major codes (with
// their scales and zeros) that PrepareCpuWeight has let go so far, for the start-up log.
size_t CpuDerivedLayoutBytes();
size_t CpuReleasedCodeBytes();

// out[t, :] = weight[ids[t], :]. ids: [T] i32; weight: [V, H]; out: [T, H].
void Embedding(const Tensor& ids, const Tensor& weight, Tensor* out);

// A vocab-parallel rank's part of an embedding: out[t, :] = weight[ids[t] - first_id, :] when
// ids[t] is in [first_id, first_id + V), else zeros (the rank that holds the row adds it).
void EmbeddingSlice(const Tensor& ids, const Tensor& weight, int64_t first_id, Tensor* out);

// dst[r, dst_col + j] = src[r, src_col + j] for every row r and j < ncols. src and dst are
// 2-d with the same number of rows and the same dtype (any), on one device.
void CopyColumns(const Tensor& src, int64_t src_col, int64_t ncols, Tensor* dst, int64_t dst_col);

// out = x @ w^T (+ bias). x: [T, in]; w: [out, in]; bias: [out] or undefined; out: [T, out].
// A defined f32 `out` gets f32 results from bf16/f16 inputs (the logits).
void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* out);

// RMSNorm over the last dim: out = x / sqrt(mean(x^2) + eps) * w. x, out: [T, H]; w: [H].
void RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor* out);
// LayerNorm over the last dim with weight and optional bias.
void LayerNorm(const Tensor& x, const Tensor& w, const Tensor* bias, float eps, Tensor* out);

// x += y (same shape).
void AddInPlace(Tensor* x, const Tensor& y);
// x += y, then out = RmsNorm(x, w): a residual add fused with the norm that follows it.
void AddRmsNorm(Tensor* x, const Tensor& y, const Tensor& w, float eps, Tensor* out);

enum class RotaryStyle {
  kNeox,  // rotate halves: (x[i], x[i + d/2]) pairs (Llama, NeoX, Qwen2, Mistral)
  kGptj,  // rotate interleaved pairs (x[2i], x[2i+1])
};
struct RotaryConfig {
  int rotary_dim = 0;  // leading dims of each head that rotate (partial rotary: < head_dim)
  RotaryStyle style = RotaryStyle::kNeox;
  std::vector<float> inv_freq;  // [rotary_dim / 2], already including any rope scaling
};
// Computes inv_freq for theta and Llama 3 style scaling (factor, low/high freq factors,
// original max positions); `llama3_factor` 0 means no scaling.
std::vector<float> RotaryInvFreq(int rotary_dim, double theta, double llama3_factor = 0,
                                 double low_freq_factor = 1, double high_freq_factor = 4,
                                 int original_max_positions = 8192);
// Rotates q: [T, Hq, D] and k: [T, Hk, D] in place by positions: [T] i32.
void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k);

// ALiBi slopes for n heads, as BLOOM / MPT define them.
std::vector<float> AlibiSlopes(int num_heads);

enum class Activation { kGeluErf, kGeluTanh, kRelu, kSilu };
// gate_up: [T, 2I] laid out [gate | up]; out: [T, I] = act(gate) * up (SwiGLU: kSilu; T5's
// gated-gelu: kGeluTanh).
void GatedActivation(Activation kind, const Tensor& gate_up, Tensor* out);
// GPT-OSS's clamped SwiGLU: gate_up [T, 2I] laid out [gate | up]; out [T, I] =
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). A NaN
// stays NaN, as torch's clamp keeps it.
void ClampedSwiGlu(const Tensor& gate_up, float alpha, float limit, Tensor* out);
// In place: GELU (erf: exact "gelu"; tanh: "gelu_new" / "gelu_pytorch_tanh" / "gelu_fast"),
// ReLU, SiLU.
void Activate(Activation kind, Tensor* x);
// Mamba-2's selective state-space mixer (GraniteMoeHybrid's "mamba" layers), the part between
// its in_proj and its gated norm, computed as its recurrence token by token. Per sequence s
// (rows [query_start[s], query_start[s + 1]) of `proj`, in order) and token:
//   xBC = silu(causal depthwise conv of xBC over the sequence (kernel K, conv_w [C, K],
//         conv_b [C] or undefined), the previous K - 1 inputs from conv_states[s] [C, K - 1]),
//   x, B, C = xBC's [I], [G, N], [G, N] parts (I = heads * head_dim, C = I + 2 G N),
//   dt = softplus(dt + dt_bias) per head, A = -exp(a_log),
//   ssm[h] = ssm[h] * exp(dt A) + dt B[g] x[h]^T (ssm_states[s] [heads, head_dim, N]; head h
//            in group g = h / (heads / G)),
//   y[h] = ssm[h] C[g] + d[h] x[h].
// proj: [T, I + C + heads] (z | xBC | dt); out: [T, 2 I] = z | y, so that
// GatedActivation(kSilu) gives the gated norm's input silu(z) * y. A sequence with fresh[s]
// starts from zero states; its states after its last row are left in conv_states and
// ssm_states. The parameters and states f32; proj and out f32 on the CPU, the activations'
// dtype on CUDA (the recurrence in f32 there too).
struct SsmConfig {
  int64_t heads = 0, head_dim = 0, groups = 0, state_size = 0, conv_kernel = 0;
};
void SelectiveScan(const SsmConfig& cfg, const Tensor& proj, const Tensor& conv_w,
                   const Tensor& conv_b, const Tensor& dt_bias, const Tensor& a_log,
                   const Tensor& d, const std::vector<int32_t>& query_start,
                   const std::vector<Tensor*>& conv_states, const std::vector<Tensor*>& ssm_states,
                   const std::vector<uint8_t>& fresh, Tensor* out);

// In place: x = min(max(x, lo), hi) (clip_qkv of MPT and OLMo).
void Clamp(float lo, float hi, Tensor* x);
// In place: x = x * factor, in f32, rounded to x's dtype (Granite's embedding and residual
// multipliers, as `tensor * python_float` computes them in PyTorch).
void Scale(float factor, Tensor* x);
// In place: x = tanh(x / cap) * cap, in f32, rounded to x's dtype (Gemma 2's final logit soft
// cap, in transformers' order of operations); cap > 0.
void SoftCap(float cap, Tensor* x);

// out[rows[i], :] += weights[i] * src[i, :] for each row i of src [N, H]: one expert's part of
// a mixture of experts' output. rows: [N] i32 or i64, distinct, each in [0, T) for out [T, H];
// weights: [N] f32; src and out share a dtype. In 16 bits the weight, the product and the sum
// are each rounded to that dtype, as transformers' Mixtral computes
// `out.index_add_(0, rows, expert(x) * weights.to(dtype))`.
void AddWeightedRows(const Tensor& src, const Tensor& rows, const Tensor& weights, Tensor* out);

// Over the last dim, in place.
void Softmax(Tensor* x);
void LogSoftmax(Tensor* x);

// Greedy choice per row of f32 logits [R, V], modified in place: the tokens listed in row r of
// `banned` ([R, M] i32, -1 = none; may be undefined) become -inf first (EOS before
// min_new_tokens); then ids[r] = the first index of the row's maximum and logprobs[r] = its
// log-softmax value. A row holding a NaN or +inf (a model that overflowed) has no choice:
// ids[r] = -1 and logprobs[r] = NaN, for the caller to fail that row's request alone.
// ids: [R] i32, logprobs: [R] f32 (allocated when undefined). On CUDA this keeps the logits
// on the device: only the ids and logprobs are copied back.
void GreedyPick(Tensor* logits, const Tensor& banned, Tensor* ids, Tensor* logprobs);

// HF's repetition penalty, in place on f32 logits [R, V]: for each token t listed in row r of
// `tokens` ([R, M] i32, -1 = none; a row's tokens distinct), logits[r, t] is divided by
// penalties[r] ([R] f32) where positive and multiplied by it where negative. Rows whose penalty
// is 1 are left as they are. On CUDA this lets penalized greedy rows pick on the device.
void RepetitionPenalty(Tensor* logits, const Tensor& tokens, const Tensor& penalties);

// What the host needs to sample a row without reading all of it: for each selected row rows[i]
// ([S] i32) of f32 logits [R, V], with x = logits[rows[i]] / temperatures[i] ([S] f32; 1: none),
// stats[i] = {lse, mass}: lse = the log-sum-exp of x as a log-softmax takes it (the max plus the
// log of the double sum of exp(x - max)), mass = the sum of the f32 probabilities exp(x - lse);
// and the `count` largest x (ties: the smaller id first), in no particular order:
// values[i, :] and ids[i, :]. A row holding a NaN or +inf has lse NaN (and ids -1).
// count <= V. values [S, count] f32, ids [S, count] i32, stats [S, 2] f32, allocated when
// undefined. On CUDA a sampled row then sends count values and ids to the host, not V logits.
void TopLogits(const Tensor& logits, const Tensor& rows, const Tensor& temperatures, int64_t count,
               Tensor* values, Tensor* ids, Tensor* stats);

// The log-sum-exp of a host row as every sampler here takes it (TopLogits' lse, the host's
// log-softmax): the largest value plus the log of the double sum of exp(x - max), -inf entries
// adding nothing. NaN when the row holds a NaN or +inf.
float LogSumExp(std::span<const float> row);

// The paged KV cache of one layer: [num_blocks, block_size, Hk, D] for keys and for values.
struct KvCacheLayer {
  Tensor k;
  Tensor v;
};

// Writes k, v: [T, Hk, D] into the cache at slot_mapping[t] (= block * block_size + offset;
// negative slots are skipped).
void ReshapeAndCache(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                     KvCacheLayer* cache);

// The attention inputs of a fused projection qkv: [T, (Hq + 2 Hk) * D] (q | k | v columns) in
// one pass: q: [T, Hq, D] gets the q columns, rotated by `positions` when `rotary` is given;
// the k columns (rotated alike) and the v columns go into the cache at slot_mapping[t]
// (negative: skipped). Bit for bit what CopyColumns into q, k, v, then Rotary, then
// ReshapeAndCache give; a decode step launches one kernel per layer instead of five.
void QkvToCache(const Tensor& qkv, const RotaryConfig* rotary, const Tensor& positions,
                const Tensor& slot_mapping, Tensor* q, KvCacheLayer* cache);

// Attention over a ragged batch whose keys/values are all in the paged cache (the new tokens'
// too: call ReshapeAndCache first). Sequence s owns query rows [query_start[s],
// query_start[s+1]) which are its last (query_start[s+1]-query_start[s]) positions of
// context_lens[s] in total; block_tables: [S, max_blocks] i32. Causal unless `causal` is false
// (then every query sees all context_lens[s] keys: encoders, cross-attention); `sliding_window`
// > 0 limits each (causal) query to that many most recent keys; `bias` adds a position bias.
// q, out: [T, Hq, D]. Hq must be a multiple of Hk (MHA, GQA, MQA).
struct AttentionBatch {
  Tensor query_start;   // [S + 1] i32
  Tensor context_lens;  // [S] i32
  Tensor block_tables;  // [S, max_blocks] i32
  int block_size = 16;
  bool causal = true;
  // max(context_lens) when the caller knows it (host side): CUDA sizes its launch by it
  // without reading context_lens back. 0: unknown.
  int64_t max_context_len = 0;
  // The shortest and longest query (rows of a sequence) when the caller knows them: CUDA skips
  // the kernels no sequence needs. 0: unknown.
  int64_t min_query_len = 0;
  int64_t max_query_len = 0;
};
// What attention adds to a (scaled) logit, by the key's position relative to the query's, and
// a soft cap applied before it. Position schemes are these biases (or rotary, applied to q and
// k before), never special cases of a model inside attention.
struct AttentionBias {
  // > 0: each scaled logit becomes tanh(logit / softcap) * softcap (Gemma 2's
  // attn_logit_softcapping), before any bias and the mask.
  float softcap = 0;
  // ALiBi: alibi_slopes[h] * (key - query); [Hq], on the host.
  std::vector<float> alibi_slopes;
  // T5: relative_table[h, RelativePositionBucket(key - query, ...)]; [Hq, num_buckets] f32 on
  // the op's device; undefined: none.
  Tensor relative_table;
  int num_buckets = 0;
  int max_distance = 0;
  bool bidirectional = false;
  // Attention sinks (GPT-OSS): sinks[h] is one more logit in head h's softmax, over no value:
  // it takes its share of the denominator only. [Hq], on the host; empty: none.
  std::vector<float> sinks;
};
void PagedAttention(const Tensor& q, const KvCacheLayer& cache, const AttentionBatch& batch,
                    float scale, int sliding_window, const AttentionBias* bias, Tensor* out);

}  // namespace tgis::kernels

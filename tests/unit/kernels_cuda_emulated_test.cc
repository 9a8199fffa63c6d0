// CUDA kernels run on the CPU under the warp emulator. Attention, against attention computed in
// double from the same stored keys and values: the tensor-core prefill kernel
// (kernels/cuda/mma_attention.cuh: fragment indexing, masking, online softmax, tiles) and the
// grouped decode kernel (grouped_attention.cuh: lane groups, query-head groups, partitions and
// their combination) are checked on every machine, GPU or not. TopLogits (top_logits.cuh: block
// reductions, radix select, ties), against the CPU op. (On a GPU, OpsTest runs the real
// kernels.) The decode GEMVs (gemv.cuh: streaming, code extraction, runs and their constants,
// tokens, the warp sums) and the tensor-core one (mma_gemv.cuh: fragment layout, split columns,
// tails), against the sums in double. Mamba-2's scan (selective_scan.cuh: the convolution and
// the recurrence over sequences' slots), against the CPU op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "warp_emulator.h"
// After the emulator, which provides the primitives the kernel uses.
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/warp_reduce.cuh"
// After warp_reduce.cuh.
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/grouped_attention.cuh"
#include "kernels/cuda/mma_attention.cuh"
#include "kernels/cuda/mma_gemv.cuh"
#include "kernels/cuda/selective_scan.cuh"
#include "kernels/cuda/top_logits.cuh"
#include "kernels/ops.h"

namespace tgis::kernels::cuda {
namespace {

struct Case {
  int hq, hk, d;
  int window = 0;
  bool alibi = false;
  bool causal = true;
  float softcap = 0;   // > 0: Gemma 2's soft cap on the scaled logits
  bool sinks = false;  // GPT-OSS's attention sinks, one logit a head in the denominator
};

struct Seq {
  int q_len, ctx;
};
enum class Kernel { kMma, kGrouped };

constexpr int kBlockSize = 16;
constexpr int kTiledMinRows = 8;

template <typename T>
std::vector<T> RandomElements(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<T> v(n);
  for (T& x : v) x = FromF32<T>(dist(rng));
  return v;
}

// Runs `kernel` on a batch of `seqs` and checks the rows it owns (the tiled kernel: sequences
// of kTiledMinRows rows or more; the grouped one: the others) against the reference, and that it
// left the other rows alone.
template <typename T>
void RunCase(Kernel kernel, const Case& c, const std::vector<Seq>& seqs, double tol) {
  const int num_seqs = static_cast<int>(seqs.size()), d = c.d;
  std::vector<int> query_start = {0}, q_lens, contexts;
  for (const Seq& s : seqs) {
    query_start.push_back(query_start.back() + s.q_len);
    q_lens.push_back(s.q_len);
    contexts.push_back(s.ctx);
  }
  const int rows = query_start.back();

  // Each sequence's blocks, scattered over the cache in a shuffled order.
  int max_blocks = 0, total_blocks = 0;
  for (int ctx : contexts) {
    max_blocks = std::max(max_blocks, (ctx + kBlockSize - 1) / kBlockSize);
    total_blocks += (ctx + kBlockSize - 1) / kBlockSize;
  }
  std::vector<int> order(total_blocks + 3);  // 3 blocks nobody owns
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(5));
  std::vector<int> tables(num_seqs * max_blocks, 0);
  for (int s = 0, next = 0; s < num_seqs; ++s) {
    for (int b = 0; b < (contexts[s] + kBlockSize - 1) / kBlockSize; ++b)
      tables[s * max_blocks + b] = order[next++];
  }
  const size_t cache_rows = order.size() * kBlockSize * c.hk;
  std::vector<T> kc = RandomElements<T>(cache_rows * d, 1),
                 vc = RandomElements<T>(cache_rows * d, 2);
  // Slots no sequence holds are NaN: reading one would show in the results.
  std::vector<bool> held(order.size() * kBlockSize, false);
  for (int s = 0; s < num_seqs; ++s) {
    for (int pos = 0; pos < contexts[s]; ++pos)
      held[tables[s * max_blocks + pos / kBlockSize] * kBlockSize + pos % kBlockSize] = true;
  }
  for (size_t slot = 0; slot < held.size(); ++slot) {
    if (held[slot]) continue;
    for (size_t i = slot * c.hk * d; i < (slot + 1) * c.hk * d; ++i)
      kc[i] = vc[i] = FromF32<T>(NAN);
  }
  const std::vector<T> q = RandomElements<T>(static_cast<size_t>(rows) * c.hq * d, 3);
  const T sentinel = FromF32<T>(-7.0f);
  std::vector<T> out(q.size(), sentinel);

  AttnParams p{};
  p.query_start = query_start.data();
  p.context_lens = contexts.data();
  p.tables = tables.data();
  p.max_blocks = max_blocks;
  p.num_seqs = num_seqs;
  p.block_size = kBlockSize;
  p.hq = c.hq;
  p.hk = c.hk;
  p.d = d;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.softcap = c.softcap;
  p.window = c.window;
  p.alibi = c.alibi;
  p.sinks = c.sinks;
  p.causal = c.causal;
  p.partitions = 1;
  p.keys_per_part = 1;
  p.tiled_min_rows = kTiledMinRows;
  HeadTerms terms{};
  for (int h = 0; h < c.hq; ++h) terms.slope[h] = std::exp2(-1.0f - static_cast<float>(h));
  // Sinks from below to above these logits (~0.6 rms), so that they take from a little to most
  // of the weight.
  for (int h = 0; h < c.hq; ++h) terms.sink[h] = -2.0f + 5.0f * static_cast<float>(h) / c.hq;
  if (kernel == Kernel::kMma) {
    if constexpr (sizeof(T) == 2) {  // tensor cores take 16-bit elements
      const EmuDim3 grid{static_cast<unsigned>((rows + kMmaTileQ - 1) / kMmaTileQ + num_seqs),
                         static_cast<unsigned>(c.hq), 1};
      EmulateLaunch(grid, kMmaThreads, &MmaAttentionKernel<T>, p, terms, q.data(), kc.data(),
                    vc.data(), out.data());
    } else {
      FAIL() << "the tensor-core kernel takes bf16 and f16";
    }
  } else {
    int keys = *std::max_element(contexts.begin(), contexts.end());
    if (c.window > 0) keys = std::min(keys, c.window);
    p.partitions = (keys + kKeysPerPart - 1) / kKeysPerPart;
    p.keys_per_part = kKeysPerPart;
    const size_t parts = static_cast<size_t>(rows) * c.hq * p.partitions;
    const int splits = (c.hq / c.hk + kGroupMax - 1) / kGroupMax;
    const EmuDim3 grid{static_cast<unsigned>(rows), static_cast<unsigned>(c.hk * splits),
                       static_cast<unsigned>(p.partitions)};
    // Every variant (PagedAttention picks one by the grid's size): kGroupUnroll direct loads,
    // one, and rows staged in shared memory; the same bits.
    using Variant = void (*)(const AttnParams, const HeadTerms, const T*, const T*, const T*, T*,
                             float*, float*, float*);
    const std::pair<Variant, const char*> variants[] = {
        {&GroupedAttentionKernel<T, kGroupUnroll, false>, "kGroupUnroll direct loads"},
        {&GroupedAttentionKernel<T, 1, false>, "one direct load"},
        {&GroupedAttentionKernel<T, 1, true>, "staged rows"}};
    std::vector<T> first;
    for (const auto& [variant, name] : variants) {
      std::vector<float> part_m(parts), part_l(parts), part_acc(parts * d);
      std::vector<T> o = out;
      EmulateLaunch(grid, kGroupThreads, variant, p, terms, q.data(), kc.data(), vc.data(),
                    o.data(), part_m.data(), part_l.data(), part_acc.data());
      if (p.partitions > 1) {
        EmulateLaunch({static_cast<unsigned>(rows), static_cast<unsigned>(c.hq), 1}, 32,
                      &CombinePartitionsKernel<T>, p, terms, part_m.data(), part_l.data(),
                      part_acc.data(), o.data());
      }
      if (first.empty()) {
        first = o;
      } else {
        ASSERT_EQ(0, std::memcmp(o.data(), first.data(), o.size() * sizeof(T)))
            << name << " and " << variants[0].second << " give other bits";
      }
    }
    out = first;
  }

  const auto cached = [&](const std::vector<T>& cache, int s, int pos, int kvh, int x) {
    const int slot = tables[s * max_blocks + pos / kBlockSize] * kBlockSize + pos % kBlockSize;
    return static_cast<double>(ToF32(cache[(static_cast<size_t>(slot) * c.hk + kvh) * d + x]));
  };
  int bad = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int i = 0; i < q_lens[s]; ++i) {
      const int row = query_start[s] + i, qpos = contexts[s] - q_lens[s] + i;
      for (int h = 0; h < c.hq; ++h) {
        const T* o = &out[(static_cast<size_t>(row) * c.hq + h) * d];
        if ((q_lens[s] >= kTiledMinRows) != (kernel == Kernel::kMma)) {  // not this kernel's
          for (int x = 0; x < d; ++x) ASSERT_EQ(ToF32(o[x]), -7.0f) << "row " << row;
          continue;
        }
        const int kvh = h / (c.hq / c.hk);
        std::vector<double> logits;
        std::vector<int> seen;
        for (int j = 0; j < (c.causal ? qpos + 1 : contexts[s]); ++j) {
          if (c.window > 0 && j <= qpos - c.window) continue;
          double dot = 0;
          for (int x = 0; x < d; ++x)
            dot +=
                ToF32(q[(static_cast<size_t>(row) * c.hq + h) * d + x]) * cached(kc, s, j, kvh, x);
          double l = dot * p.scale;
          if (c.softcap > 0) l = std::tanh(l / c.softcap) * c.softcap;
          logits.push_back(l + (c.alibi ? terms.slope[h] * (j - qpos) : 0.0));
          seen.push_back(j);
        }
        double mx = *std::max_element(logits.begin(), logits.end());
        if (c.sinks) mx = std::max(mx, double{terms.sink[h]});
        double sum = c.sinks ? std::exp(terms.sink[h] - mx) : 0;
        for (double& l : logits) sum += (l = std::exp(l - mx));
        for (int x = 0; x < d; ++x) {
          double want = 0, mag = 1e-3;
          for (size_t n = 0; n < seen.size(); ++n) {
            const double v = cached(vc, s, seen[n], kvh, x);
            want += logits[n] / sum * v;
            mag += logits[n] / sum * std::fabs(v);
          }
          const double got = ToF32(o[x]);
          if (!(std::fabs(got - want) <= tol * (mag + std::fabs(want))) && ++bad <= 5) {
            ADD_FAILURE() << "row " << row << " head " << h << " dim " << x << ": got " << got
                          << " want " << want;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// Sequences as (query rows, context). For the tiled kernel: a prompt over two tiles (the second
// partial), a chunk late in a context (many key chunks), a chunk whose first key chunk ends
// inside a warp's rows (masked there, whole for the warps after), one at the threshold, and two
// below it that are not its own. For the grouped one: a decode over three partitions, a short
// chunk, a prompt that is not its own, a first token, and two rows over two partitions.
const std::vector<Seq> kPrefills = {{100, 100}, {70, 300}, {40, 100}, {8, 8}, {1, 50}, {7, 20}};
const std::vector<Seq> kDecodes = {{1, 1030}, {3, 20}, {9, 30}, {1, 1}, {2, 520}};

// Tolerances as OpsTest's for the element type (kernels_ops_test.cc's RelTol); the tensor-core
// kernel adds one rounding of each probability to the element type.
TEST(AttentionEmulated, MmaCausalHeadDimsBf16) {
  for (int d : {64, 80, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    RunCase<EmuBf16>(Kernel::kMma, {d == 128 ? 4 : 2, d == 128 ? 2 : 1, d}, kPrefills, 1e-2);
  }
}
TEST(AttentionEmulated, MmaWindowAlibiMqaF16) {
  RunCase<EmuF16>(Kernel::kMma, {4, 1, 64, /*window=*/40, /*alibi=*/true}, kPrefills, 2e-3);
}
// A window longer than a chunk: whole chunks before the diagonal that the window cuts for a
// warp's later rows.
TEST(AttentionEmulated, MmaLongWindowBf16) {
  RunCase<EmuBf16>(Kernel::kMma, {2, 1, 64, /*window=*/90}, kPrefills, 1e-2);
}
TEST(AttentionEmulated, MmaNotCausalF16) {
  RunCase<EmuF16>(Kernel::kMma, {2, 2, 96, 0, false, /*causal=*/false}, kPrefills, 2e-3);
}
// GQA 4 at head sizes of 16 and 10 pieces; 10 query heads of one KV head (two head groups) with a
// window and ALiBi; f32 rows of 64 pieces (two a lane) without causality.
TEST(AttentionEmulated, GroupedGqaBf16) {
  for (int d : {128, 80}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    RunCase<EmuBf16>(Kernel::kGrouped, {4, 1, d}, kDecodes, 1e-2);
  }
}
TEST(AttentionEmulated, GroupedMqaWindowAlibiF16) {
  RunCase<EmuF16>(Kernel::kGrouped, {10, 1, 64, /*window=*/40, /*alibi=*/true}, kDecodes, 2e-3);
}
// Gemma 2's soft cap (0.2, where these scaled logits are ~0.33 rms), with a window, on both
// kernels.
TEST(AttentionEmulated, MmaSoftCapWindowBf16) {
  Case c{4, 2, 128, /*window=*/40};
  c.softcap = 0.2f;
  RunCase<EmuBf16>(Kernel::kMma, c, kPrefills, 1e-2);
}
TEST(AttentionEmulated, GroupedSoftCapWindowF16) {
  Case c{4, 1, 64, /*window=*/40};
  c.softcap = 0.2f;
  RunCase<EmuF16>(Kernel::kGrouped, c, kDecodes, 2e-3);
}
// GPT-OSS's attention sinks, with its sliding window and GQA on the tensor-core kernel, and on
// the grouped one (whose decode over three partitions adds the sink once, combining them).
TEST(AttentionEmulated, MmaSinksWindowBf16) {
  Case c{8, 2, 64, /*window=*/40};
  c.sinks = true;
  RunCase<EmuBf16>(Kernel::kMma, c, kPrefills, 1e-2);
}
TEST(AttentionEmulated, GroupedSinksF16) {
  Case c{4, 1, 64};
  c.sinks = true;
  RunCase<EmuF16>(Kernel::kGrouped, c, kDecodes, 2e-3);
}
TEST(AttentionEmulated, GroupedNotCausalF32) {
  RunCase<float>(Kernel::kGrouped, {1, 1, 256, 0, false, /*causal=*/false}, kDecodes, 1e-5);
}

// The emulated kernel's values and ids are the CPU op's (as sets: neither orders them), and its
// log-sum-exp and mass agree within the summation order's rounding; a row with a NaN gets ids
// -1. Rows with a plateau of ties across the cut, -inf entries, temperatures; count 1, 37, V.
TEST(TopLogitsEmulated, MatchesTheCpuOp) {
  const int64_t rows = 3, v = 2500;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-6.0f, 6.0f);
  std::vector<float> x(rows * v);
  for (float& f : x) f = dist(rng);
  for (int64_t i = 0; i < v; i += 4) x[v + i] = 1.25f;
  for (int64_t i = 0; i < v; i += 5) x[2 * v + i] = -INFINITY;
  std::vector<float> nan_row(x.begin(), x.begin() + v);
  nan_row[77] = NAN;
  x.insert(x.end(), nan_row.begin(), nan_row.end());
  const std::vector<int32_t> picked = {2, 0, 1, 3};
  const std::vector<float> temps = {0.9f, 1.0f, 1.3f, 1.0f};
  for (int count : {1, 37, static_cast<int>(v)}) {
    SCOPED_TRACE("count " + std::to_string(count));
    const int s = static_cast<int>(picked.size());
    std::vector<float> values(s * count), stats(s * 2);
    std::vector<int> ids(s * count);
    EmulateLaunch({static_cast<unsigned>(s), 1, 1}, kTopThreads, &TopLogitsKernel, x.data(), v,
                  picked.data(), temps.data(), count, values.data(), ids.data(), stats.data());
    Tensor want_v, want_i, want_s;
    kernels::TopLogits(Tensor::FromVector(x, {rows + 1, v}), Tensor::FromVector(picked, {s}),
                       Tensor::FromVector(temps, {s}), count, &want_v, &want_i, &want_s);
    for (int i = 0; i < s; ++i) {
      if (picked[i] == 3) {
        EXPECT_TRUE(std::isnan(stats[i * 2]));
        EXPECT_EQ(ids[i * count], -1);
        continue;
      }
      EXPECT_NEAR(stats[i * 2], want_s.data<float>()[i * 2], 1e-6);
      EXPECT_NEAR(stats[i * 2 + 1], want_s.data<float>()[i * 2 + 1], 1e-6);
      std::vector<std::pair<float, int>> got, want;
      for (int k = 0; k < count; ++k) {
        got.push_back({values[i * count + k], ids[i * count + k]});
        want.push_back(
            {want_v.data<float>()[i * count + k], want_i.data<int32_t>()[i * count + k]});
      }
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << "row " << i;
    }
  }
}

// ---- decode GEMVs --------------------------------------------------------------------------

// A quantized weight in kernels/quantized.h's layout, with the values its codes stand for.
struct GemvWeight {
  int bits;
  int64_t out, in, runs;
  CodeValues values;
  std::vector<uint8_t> codes;        // [out, in * bits / 8]
  std::vector<float> scales, zeros;  // [out, runs]
  std::vector<int32_t> block_run;    // [in / 8]
  std::vector<int32_t> gather;       // [in] stored column -> x column (-1: padding); empty: none

  int64_t code_row() const { return in * bits / 8; }
  uint32_t Code(int64_t n, int64_t j) const {
    const uint8_t byte = codes[n * code_row() + j * bits / 8];
    return bits == 8 ? byte : (byte >> (4 * (j % 2))) & 0xF;
  }
  double Value(uint32_t code) const {
    switch (values.kind) {
      case CodeValues::kTable:
        return values.table[code];
      case CodeValues::kFp8:
        return Fp8E4M3ToF32(static_cast<uint8_t>(code));
      default:
        return code;
    }
  }
};

GemvWeight RandomGemvWeight(int bits, CodeValues::Kind kind, int64_t out, int64_t in, int group,
                            bool fractional_zeros, uint32_t seed) {
  std::mt19937 rng(seed);
  GemvWeight w{bits, out, in, (in + group - 1) / group, {}, {}, {}, {}, {}, {}};
  w.values.kind = kind;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), scale(0.01f, 0.05f);
  for (float& t : w.values.table) t = unit(rng);
  std::uniform_int_distribution<int> byte(0, 255);
  w.codes.resize(out * w.code_row());
  for (uint8_t& c : w.codes) {
    c = static_cast<uint8_t>(byte(rng));
    if (kind == CodeValues::kFp8 && (c & 0x7F) == 0x7F) c ^= 1;  // no NaN codes
  }
  for (int64_t i = 0; i < out * w.runs; ++i) {
    w.scales.push_back(scale(rng));
    const float z = kind == CodeValues::kInteger ? static_cast<float>(byte(rng) >> (8 - bits)) : 0;
    w.zeros.push_back(fractional_zeros && i % 3 == 0 ? z + 0.375f : z);
  }
  for (int64_t b = 0; b < in / 8; ++b) w.block_run.push_back(static_cast<int32_t>(b * 8 / group));
  return w;
}

// y[t, n] in double, from x as the kernel reads it ([tokens, ld], columns through the gather).
std::vector<double> GemvReference(const GemvWeight& w, const std::vector<float>& x, int64_t ld,
                                  int tokens, const std::vector<float>& bias,
                                  std::vector<double>* magnitude) {
  std::vector<double> y(tokens * w.out, 0.0);
  magnitude->assign(y.size(), 0.0);
  for (int t = 0; t < tokens; ++t) {
    for (int64_t n = 0; n < w.out; ++n) {
      double sum = bias[n], mag = std::fabs(sum);
      for (int64_t j = 0; j < w.in; ++j) {
        const int64_t col = w.gather.empty() ? j : w.gather[j];
        if (col < 0) continue;
        const int32_t run = w.block_run[j / 8];
        const double term = (w.Value(w.Code(n, j)) - w.zeros[n * w.runs + run]) *
                            w.scales[n * w.runs + run] * x[t * ld + col];
        sum += term;
        mag += std::fabs(term);
      }
      y[t * w.out + n] = sum;
      (*magnitude)[t * w.out + n] = mag;
    }
  }
  return y;
}

// Runs one quantized GEMV on `tokens` rows of x and checks it: the wide kernel (x in the
// stored column order), or with `scalar` the one that reads x through the gather. T: x's and
// the output's element type; kTokens: the wide kernel's accumulators.
template <typename T, int kTokens>
void RunQuantizedGemv(const GemvWeight& w, int tokens, bool scalar, double tol,
                      const std::string& what) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  int64_t ld = w.in;
  for (int32_t c : w.gather) ld = std::max<int64_t>(ld, c + 1);
  std::vector<T> x(tokens * ld), bias(w.out);
  std::vector<float> xf(x.size()), bias_f(w.out);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = ToF32(x[i] = FromF32<T>(unit(rng)));
  for (int64_t n = 0; n < w.out; ++n) bias_f[n] = ToF32(bias[n] = FromF32<T>(unit(rng)));
  std::vector<double> magnitude;
  const std::vector<double> want = GemvReference(w, xf, ld, tokens, bias_f, &magnitude);
  std::vector<T> y(tokens * w.out);
  const EmuDim3 grid{static_cast<unsigned>((w.out + kGemvWarps - 1) / kGemvWarps), 1, 1};
  const T* xp = x.data();
  const T* bp = bias.data();
  if (scalar) {
    EmulateLaunch(grid, kGemvWarps * 32, &QuantizedGemvKernel<T, T>, w.codes.data(), w.code_row(),
                  w.bits, w.values, w.scales.data(), w.zeros.data(), w.runs, w.block_run.data(),
                  w.gather.empty() ? nullptr : w.gather.data(), w.out, ld, xp, tokens, bp,
                  y.data());
  } else if (w.bits == 4) {
    EmulateLaunch(grid, kGemvWarps * 32, &QuantizedGemvWideKernel<T, T, kTokens, 4>, w.codes.data(),
                  w.code_row(), w.values, w.scales.data(), w.zeros.data(), w.runs,
                  w.block_run.data(), w.out, w.in, xp, tokens, bp, y.data());
  } else {
    EmulateLaunch(grid, kGemvWarps * 32, &QuantizedGemvWideKernel<T, T, kTokens, 8>, w.codes.data(),
                  w.code_row(), w.values, w.scales.data(), w.zeros.data(), w.runs,
                  w.block_run.data(), w.out, w.in, xp, tokens, bp, y.data());
  }
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double got = ToF32(y[i]);
    if (std::fabs(got - want[i]) > tol * (magnitude[i] + std::fabs(want[i])) && ++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << " got " << got << " want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// Integer codes with integer zeros (the exact subtraction) and with fractional ones, in groups
// of 32 and per row; 11 rows (a partial block of warps); rows of 144 16-byte vectors of 4-bit
// codes (two chunks of StreamRow<2> and a tail); f32 and bf16 x.
TEST(GemvEmulated, QuantizedIntegerCodes) {
  for (bool fractional : {false, true}) {
    const GemvWeight w4 =
        RandomGemvWeight(4, CodeValues::kInteger, 11, 4608, 32, fractional, 11 + fractional);
    const std::string z = fractional ? " fractional zeros" : "";
    RunQuantizedGemv<float, 1>(w4, 1, false, 1e-5, "4-bit f32 T=1" + z);
    RunQuantizedGemv<EmuBf16, kQuantizedGemvTokens>(w4, 12, false, 1e-2, "4-bit bf16 T=12" + z);
    const GemvWeight w8 =
        RandomGemvWeight(8, CodeValues::kInteger, 11, 1040, 1040, fractional, 21 + fractional);
    RunQuantizedGemv<float, kGemvTokens>(w8, 3, false, 1e-5, "8-bit f32 T=3" + z);
    RunQuantizedGemv<EmuBf16, 1>(w8, 1, false, 1e-2, "8-bit bf16 T=1" + z);
  }
}

// A 16-value table (bitsandbytes nf4) with 4-bit codes, float8 e4m3 with 8-bit ones.
TEST(GemvEmulated, QuantizedTableAndFp8Codes) {
  const GemvWeight nf4 = RandomGemvWeight(4, CodeValues::kTable, 9, 1024, 64, false, 31);
  RunQuantizedGemv<EmuF16, 1>(nf4, 1, false, 2e-3, "nf4 f16 T=1");
  RunQuantizedGemv<float, kQuantizedGemvTokens>(nf4, 16, false, 1e-5, "nf4 f32 T=16");
  const GemvWeight fp8 = RandomGemvWeight(8, CodeValues::kFp8, 9, 512, 512, false, 32);
  RunQuantizedGemv<float, kGemvTokens>(fp8, 5, false, 1e-5, "fp8 f32 T=5");
}

// The scalar kernel: an act-order gather (a permutation with padding) over rows whose bytes are
// not whole 16-byte vectors, at every token count it takes.
TEST(GemvEmulated, QuantizedScalarKernelWithGather) {
  GemvWeight w = RandomGemvWeight(4, CodeValues::kInteger, 10, 200, 40, true, 41);
  std::vector<int32_t> cols(196);
  std::iota(cols.begin(), cols.end(), 0);
  std::shuffle(cols.begin(), cols.end(), std::mt19937(42));
  cols.insert(cols.end(), 4, -1);  // the stored row pads 196 columns to 200
  w.gather = cols;
  for (int tokens : {1, 7, 16}) {
    RunQuantizedGemv<float, 1>(w, tokens, true, 1e-5, "scalar T=" + std::to_string(tokens));
  }
  const GemvWeight w8 = RandomGemvWeight(8, CodeValues::kInteger, 5, 72, 8, false, 43);
  RunQuantizedGemv<EmuBf16, 1>(w8, 2, true, 1e-2, "scalar 8-bit bf16");
}

// The dense GEMV against the sums in double: bf16 rows of 4 chunks of StreamRow<4> and a tail,
// f32 rows of fewer vectors than a chunk; 1 and 5 tokens.
// Checks a dense GEMV's outputs y [tokens, out] against x . w^T + bias in double, within tol
// times the sum of the terms' magnitudes.
template <typename T>
void ExpectDenseGemv(const std::vector<T>& w, const std::vector<T>& x, const std::vector<T>& bias,
                     const std::vector<float>& y, int64_t out, int64_t in, int tokens, double tol,
                     const std::string& what) {
  int bad = 0;
  for (int t = 0; t < tokens; ++t) {
    for (int64_t n = 0; n < out; ++n) {
      double want = ToF32(bias[n]), mag = std::fabs(want);
      for (int64_t j = 0; j < in; ++j) {
        const double term = static_cast<double>(ToF32(w[n * in + j])) * ToF32(x[t * in + j]);
        want += term;
        mag += std::fabs(term);
      }
      if (std::fabs(y[t * out + n] - want) > tol * mag && ++bad <= 5) {
        ADD_FAILURE() << what << " T=" << t << " row " << n << " got " << y[t * out + n] << " want "
                      << want;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(GemvEmulated, DenseRows) {
  auto run = [](auto zero, int64_t out, int64_t in, int tokens, double tol) {
    using T = decltype(zero);
    std::mt19937 rng(51);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<T> w(out * in), x(tokens * in), bias(out);
    for (T& v : w) v = FromF32<T>(unit(rng));
    for (T& v : x) v = FromF32<T>(unit(rng));
    for (T& v : bias) v = FromF32<T>(unit(rng));
    std::vector<float> y(tokens * out);
    const EmuDim3 grid{static_cast<unsigned>((out + kGemvWarps - 1) / kGemvWarps), 1, 1};
    const T* wp = w.data();
    const T* xp = x.data();
    const T* bp = bias.data();
    if (tokens == 1) {
      EmulateLaunch(grid, kGemvWarps * 32, &DenseGemvKernel<T, float, 1>, wp, out, in, xp, tokens,
                    bp, y.data());
    } else {
      EmulateLaunch(grid, kGemvWarps * 32, &DenseGemvKernel<T, float, kGemvTokens>, wp, out, in, xp,
                    tokens, bp, y.data());
    }
    ExpectDenseGemv(w, x, bias, y, out, in, tokens, tol, "CUDA-core GEMV");
  };
  run(EmuBf16{}, 10, 8 * (4 * 128 + 40), 1, 1e-5);
  run(EmuBf16{}, 9, 8 * 100, 5, 1e-5);
  run(0.0f, 3, 4 * 24, 5, 1e-5);
}

// The tensor-core GEMV (16-bit weights): against the sums in double for 1, 3 and 8 tokens,
// with rows past a 16-row tile, columns that end inside a 32-column step and inside a chunk of
// a warp's steps, and a bias; and each token's outputs the same bits whatever the tokens beside
// it (the emulated mma sums in double, so this checks the kernel's own order, not the
// hardware's).
template <typename T>
void RunMmaGemv(int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<T> w(out * in), x(kGemvTokens * in), bias(out);
  for (T& v : w) v = FromF32<T>(unit(rng));
  for (T& v : x) v = FromF32<T>(unit(rng));
  for (T& v : bias) v = FromF32<T>(unit(rng));
  const EmuDim3 grid{static_cast<unsigned>((out + kMmaGemvRows - 1) / kMmaGemvRows), 1, 1};
  auto gemv = [&](int first, int tokens) {
    std::vector<float> y(tokens * out, -7.0f);
    const T* xp = x.data() + first * in;
    const T* wp = w.data();
    const T* bp = bias.data();
    EmulateLaunch(grid, kMmaGemvWarps * 32, &MmaGemvKernel<T, float>, wp, out, in, xp, tokens, bp,
                  y.data());
    return y;
  };
  const std::vector<float> all = gemv(0, kGemvTokens);
  ExpectDenseGemv(w, x, bias, all, out, in, kGemvTokens, 1e-5,
                  "tensor-core GEMV out " + std::to_string(out) + " in " + std::to_string(in));
  for (const auto& [first, tokens] : {std::pair{0, 1}, std::pair{5, 1}, std::pair{2, 3}}) {
    const std::vector<float> some = gemv(first, tokens);
    for (int64_t i = 0; i < tokens * out; ++i) {
      ASSERT_EQ(some[i], all[first * out + i]) << "tokens " << first << ".." << first + tokens;
    }
  }
}

// The tensor-core GEMV for 4-bit integer codes, against the sums in double: 16 tokens, then
// tokens alone and in small groups (the 8-token kernel) and across the 8-token boundary, each
// the same bits as among all 16.
template <typename T>
void RunMmaQuantGemv(const GemvWeight& w, const std::string& what) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  constexpr int kAll = kQuantizedGemvTokens;
  std::vector<T> x(kAll * w.in), bias(w.out);
  std::vector<float> xf(x.size()), bias_f(w.out);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = ToF32(x[i] = FromF32<T>(unit(rng)));
  for (int64_t n = 0; n < w.out; ++n) bias_f[n] = ToF32(bias[n] = FromF32<T>(unit(rng)));
  const EmuDim3 grid{static_cast<unsigned>((w.out + kMmaGemvRows - 1) / kMmaGemvRows), 1, 1};
  auto gemv = [&](int first, int tokens) {
    std::vector<float> y(tokens * w.out, -7.0f);
    const T* xp = x.data() + first * w.in;
    const T* bp = bias.data();
    auto kernel = tokens <= kGemvTokens ? &MmaQuantGemvKernel<T, float, kGemvTokens>
                                        : &MmaQuantGemvKernel<T, float, kQuantizedGemvTokens>;
    EmulateLaunch(grid, kMmaGemvWarps * 32, kernel, w.codes.data(), w.code_row(), w.scales.data(),
                  w.zeros.data(), w.runs, w.block_run.data(), w.out, w.in, xp, tokens, bp,
                  y.data());
    return y;
  };
  const std::vector<float> all = gemv(0, kAll);
  std::vector<double> magnitude;
  const std::vector<double> want = GemvReference(w, xf, w.in, kAll, bias_f, &magnitude);
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::fabs(all[i] - want[i]) > 1e-5 * (magnitude[i] + std::fabs(want[i])) && ++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << " got " << all[i] << " want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
  for (const auto& [first, tokens] :
       {std::pair{0, 1}, std::pair{5, 1}, std::pair{2, 3}, std::pair{9, 7}, std::pair{3, 9}}) {
    const std::vector<float> some = gemv(first, tokens);
    for (int64_t i = 0; i < tokens * w.out; ++i) {
      ASSERT_EQ(some[i], all[first * w.out + i])
          << what << ": tokens " << first << ".." << first + tokens;
    }
  }
}

TEST(GemvEmulated, MmaQuantizedRows) {
  // Groups of 128: two tiles of rows, the second partial; several chunks a warp and a last
  // chunk of 3 quarters.
  RunMmaQuantGemv<EmuBf16>(
      RandomGemvWeight(4, CodeValues::kInteger, 21, 128 * 8 * 2 + 96, 128, false, 71), "bf16 g128");
  // One run a row (per-channel), f16, fewer chunks than warps.
  RunMmaQuantGemv<EmuF16>(RandomGemvWeight(4, CodeValues::kInteger, 16, 640, 640, false, 72),
                          "f16 per row");
}

TEST(GemvEmulated, MmaDenseRows) {
  RunMmaGemv<EmuBf16>(21, 8 * (4 * 8 * 4 + 14), 61);  // two tiles, the second partial; a tail
  RunMmaGemv<EmuF16>(16, 8 * 3, 62);                  // fewer steps than warps
  RunMmaGemv<EmuBf16>(5, 8 * 4 * 8 * 9, 63);          // whole chunks and a partial one
}

// The scan kernels as SelectiveScan launches them, against the CPU op on the same inputs: three
// sequences of 7, 1 and 4 tokens (N = 20: two whole 8-lane partial sums and a tail), twice,
// the second call carrying sequence 1 on while 0 and 2 start fresh; the recurrence with a
// block as wide as the head and with one narrower than it (its rows going round).
TEST(ScanEmulated, MatchesTheCpuOp) {
  const SsmConfig cfg{6, 5, 3, 20, 4};
  const ScanSizes sz{6, 5, 3, 20, 4, 30, 30 + 2 * 3 * 20, 30 + 150 + 6};
  const std::vector<int32_t> starts = {0, 7, 8, 12};
  auto random = [](size_t n, uint32_t seed, float scale) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  };
  const std::vector<float> w = random(sz.channels * 4, 1, 0.5f), b = random(sz.channels, 2, 0.1f);
  const std::vector<float> dtb = random(6, 3, 1), alog = random(6, 4, 1), dd = random(6, 5, 1);
  auto tensor = [](const std::vector<float>& v) {
    return Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
  };
  for (const int scan_threads : {32, 2}) {
    std::vector<Tensor> conv, ssm;  // the CPU op's
    std::vector<std::vector<float>> our_conv, our_ssm;
    for (int s = 0; s < 3; ++s) {
      conv.push_back(Tensor::Zeros({sz.channels, 3}, DType::kF32));
      ssm.push_back(Tensor::Zeros({6, 5, 20}, DType::kF32));
      our_conv.emplace_back(sz.channels * 3, 7.0f);  // fresh slots hold garbage
      our_ssm.emplace_back(6 * 5 * 20, 7.0f);
    }
    const std::vector<std::vector<uint8_t>> fresh = {{1, 1, 1}, {1, 0, 1}};
    for (int call = 0; call < 2; ++call) {
      const std::vector<float> proj = random(12 * sz.width, 10 + call, 2);
      Tensor ref = Tensor::Zeros({12, 2 * sz.inner}, DType::kF32);
      std::vector<Tensor*> conv_p, ssm_p;
      for (int s = 0; s < 3; ++s) {
        conv_p.push_back(&conv[s]);
        ssm_p.push_back(&ssm[s]);
      }
      kernels::SelectiveScan(cfg, Tensor::FromVector(proj, {12, sz.width}),
                             Tensor::FromVector(w, {sz.channels, 4}), tensor(b), tensor(dtb),
                             tensor(alog), tensor(dd), starts, conv_p, ssm_p, fresh[call], &ref);
      ScanBatch batch{};
      for (int s = 0; s < 3; ++s) {
        batch.seq[s] = {our_conv[s].data(), our_ssm[s].data(), starts[s], starts[s + 1],
                        fresh[call][s]};
      }
      std::vector<float> xbc(12 * sz.channels), out(12 * 2 * sz.inner);
      EmulateLaunch({3, 2, 1}, 128, &ConvKernel<float>, batch, sz, proj.data(), w.data(), b.data(),
                    xbc.data(), out.data());
      EmulateLaunch({3, 6, 1}, scan_threads, &ScanKernel<float>, batch, sz,
                    static_cast<const float*>(proj.data()), static_cast<const float*>(xbc.data()),
                    dtb.data(), alog.data(), dd.data(), out.data());
      const std::string what =
          "call " + std::to_string(call) + ", " + std::to_string(scan_threads) + " threads";
      const float* want = ref.data<float>();
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << what << " out " << i;
      }
      for (int s = 0; s < 3; ++s) {
        for (size_t i = 0; i < our_conv[s].size(); ++i) {
          ASSERT_EQ(our_conv[s][i], conv[s].data<float>()[i]) << what << " conv state " << s;
        }
        for (size_t i = 0; i < our_ssm[s].size(); ++i) {
          ASSERT_NEAR(our_ssm[s][i], ssm[s].data<float>()[i],
                      1e-6f * (1 + std::fabs(ssm[s].data<float>()[i])))
              << what << " ssm state " << s << " element " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

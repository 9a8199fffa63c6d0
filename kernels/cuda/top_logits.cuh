// Internal: TopLogits (ops.h) on CUDA, one block per selected row: the row's maximum, its
// log-sum-exp (a double sum, as the host sampler's log-softmax), the f32 probabilities' total,
// and the `count` largest values by a radix select on the values' order-preserving bit keys (11,
// 11 and 10 bits: three histogram passes find the count-th largest key exactly), then one pass
// that writes every larger value and, in id order, as many of the values equal to it as are
// still wanted. Only S x count values and ids leave the device, not S x V logits.
//
// Like the attention kernels, it needs its includer to provide the CUDA keywords and primitives
// (common.cuh in the build, tests/unit/warp_emulator.h in the test that runs it on the CPU).
#pragma once

#include <cstdint>

namespace tgis::kernels::cuda {
// Internal linkage: the warp emulator's test compiles these same kernels for the host, and the
// two definitions must not meet at link time.
namespace {

constexpr int kTopThreads = 256;
constexpr int kTopWarps = kTopThreads / 32;

__device__ __forceinline__ uint32_t OrderedKey(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// A sum or max over the block, the same value in every thread, combined in a fixed order.
template <bool kMax, typename T>
__device__ __forceinline__ T TopBlockReduce(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? (other > v ? other : v) : v + other;
  }
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kTopWarps; ++w) v = kMax ? (scratch[w] > v ? scratch[w] : v) : v + scratch[w];
  return v;
}

// Exclusive prefix sum of one int per thread, in thread order; `scan` holds kTopThreads ints.
__device__ __forceinline__ int TopBlockScan(int v, int* scan) {
  const int tid = threadIdx.x;
  __syncthreads();
  scan[tid] = v;
  __syncthreads();
  for (int o = 1; o < kTopThreads; o <<= 1) {
    const int add = tid >= o ? scan[tid - o] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  return scan[tid] - v;
}

__global__ void __launch_bounds__(kTopThreads)
    TopLogitsKernel(const float* logits, int64_t v, const int* rows, const float* temperatures,
                    int count, float* values, int* ids, float* stats) {
  PriorGridsDone();
  constexpr int kBins = 2048;
  __shared__ int hist[kBins];
  __shared__ int scan[kTopThreads];
  __shared__ float fscratch[kTopWarps];
  __shared__ double dscratch[kTopWarps];
  __shared__ int chosen_bin, chosen_above, written;
  const int tid = threadIdx.x;
  const int64_t i_row = blockIdx.x;
  const float* x = logits + static_cast<int64_t>(rows[i_row]) * v;
  const float temperature = temperatures[i_row];
  float* out_v = values + i_row * count;
  int* out_i = ids + i_row * count;

  float mx = -INFINITY;
  for (int64_t i = tid; i < v; i += kTopThreads) mx = fmaxf(mx, x[i] / temperature);
  mx = TopBlockReduce<true>(mx, fscratch);
  double sum = 0;
  for (int64_t i = tid; i < v; i += kTopThreads) {
    const float f = x[i] / temperature;
    if (f != -INFINITY) sum += exp(static_cast<double>(f - mx));
  }
  sum = TopBlockReduce<false>(sum, dscratch);
  const float lse = mx + static_cast<float>(log(sum));
  double mass = 0;
  for (int64_t i = tid; i < v; i += kTopThreads) mass += expf(x[i] / temperature - lse);
  mass = TopBlockReduce<false>(mass, dscratch);
  // NaN anywhere makes the sum NaN; +inf makes the max +inf and exp(inf - inf) NaN.
  if (lse != lse) {
    for (int i = tid; i < count; i += kTopThreads) {
      out_v[i] = NAN;
      out_i[i] = -1;
    }
    if (tid == 0) stats[i_row * 2] = stats[i_row * 2 + 1] = NAN;
    return;
  }
  if (tid == 0) {
    stats[i_row * 2] = lse;
    stats[i_row * 2 + 1] = static_cast<float>(mass);
  }

  // The count-th largest key, 11 + 11 + 10 bits at a time: `prefix` holds the bits found,
  // `need` how many of the keys under it are still wanted.
  uint32_t prefix = 0, mask = 0;
  int need = count;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const int bins = pass == 2 ? 1024 : 2048;
    __syncthreads();
    for (int b = tid; b < kBins; b += kTopThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t i = tid; i < v; i += kTopThreads) {
      const uint32_t key = OrderedKey(x[i] / temperature);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & (bins - 1)], 1);
    }
    __syncthreads();
    // Thread t owns bins (kTopThreads - 1 - t) * per + [0, per): counting from the top bin down,
    // thread order is bin order descending, so an exclusive scan gives the keys above a thread's.
    const int per = bins / kTopThreads;
    const int first = (kTopThreads - 1 - tid) * per;
    int mine = 0;
    for (int b = first; b < first + per; ++b) mine += hist[b];
    int above = TopBlockScan(mine, scan);
    for (int b = first + per - 1; b >= first; --b) {
      if (above < need && above + hist[b] >= need) {
        chosen_bin = b;
        chosen_above = above;
      }
      above += hist[b];
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(chosen_bin) << shift;
    mask |= static_cast<uint32_t>(bins - 1) << shift;
    need -= chosen_above;
  }
  // Every key above `prefix` (count - need of them), then `need` keys equal to it, by id.
  if (tid == 0) written = 0;
  __syncthreads();
  for (int64_t i = tid; i < v; i += kTopThreads) {
    const float f = x[i] / temperature;
    if (OrderedKey(f) > prefix) {
      const int at = atomicAdd(&written, 1);
      out_v[at] = f;
      out_i[at] = static_cast<int>(i);
    }
  }
  const int64_t span = (v + kTopThreads - 1) / kTopThreads;
  const int64_t begin = tid * span, end = begin + span < v ? begin + span : v;
  int ties = 0;
  for (int64_t i = begin; i < end; ++i) ties += OrderedKey(x[i] / temperature) == prefix;
  int rank = TopBlockScan(ties, scan);
  for (int64_t i = begin; i < end && rank < need; ++i) {
    const float f = x[i] / temperature;
    if (OrderedKey(f) != prefix) continue;
    out_v[count - need + rank] = f;
    out_i[count - need + rank] = static_cast<int>(i);
    ++rank;
  }
}

}  // namespace
}  // namespace tgis::kernels::cuda

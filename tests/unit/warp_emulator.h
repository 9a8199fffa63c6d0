// A CPU emulator of the CUDA execution model for the warp-level kernels written to run on it
// (kernels/cuda/mma_attention.cuh): one host thread per CUDA thread, the blocks of a grid one
// after another, __shared__ variables as function statics (one block runs at a time), and the
// warp-collective operations (shuffles, mma.m16n8k16) exchanging values through per-warp slots
// behind a barrier, with the fragment layouts of the PTX ISA. A test then checks a kernel's
// indexing and arithmetic on machines without a GPU. Threads of a warp that do not reach the
// same collective (divergence, which the hardware forbids too) abort the test with a message
// instead of hanging.
//
// Include it instead of the CUDA headers, before the kernel, in one test file only: it
// defines the CUDA keywords as macros. That file compiles with -Wno-unknown-pragmas (the
// kernels' `#pragma unroll`; GCC's diagnostic pragmas do not reach preprocessor warnings).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/tensor.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static

namespace tgis::kernels::cuda {

using std::exp;
using std::log;
using std::max;
using std::memcpy;
using std::min;

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx, blockIdx;
inline EmuDim3 blockDim;

// 16-bit element types as bit patterns (the kernels only move them and convert them).
struct EmuBf16 {
  uint16_t bits;
};
struct EmuF16 {
  uint16_t bits;
};

template <typename T>
float ToF32(T v);
template <>
inline float ToF32<float>(float v) {
  return v;
}
template <>
inline float ToF32<EmuBf16>(EmuBf16 v) {
  return Bf16ToF32(v.bits);
}
template <>
inline float ToF32<EmuF16>(EmuF16 v) {
  return F16ToF32(v.bits);
}
template <typename T>
T FromF32(float v);
template <>
inline float FromF32<float>(float v) {
  return v;
}
template <>
inline EmuBf16 FromF32<EmuBf16>(float v) {
  return {F32ToBf16(v)};
}
template <>
inline EmuF16 FromF32<EmuF16>(float v) {
  return {F32ToF16(v)};
}

template <typename T>
uint32_t JoinHalves(T lo, T hi) {
  return static_cast<uint32_t>(lo.bits) | (static_cast<uint32_t>(hi.bits) << 16);
}
template <typename T>
constexpr uint32_t HalfMagicBits();
template <>
constexpr uint32_t HalfMagicBits<EmuBf16>() {
  return 0x4300u;
}
template <>
constexpr uint32_t HalfMagicBits<EmuF16>() {
  return 0x6400u;
}
template <typename T>
uint32_t SubHalves(uint32_t a, uint32_t b) {
  const auto half = [](uint32_t r, int i) {
    return ToF32(T{static_cast<uint16_t>(r >> (16 * i))});
  };
  return JoinHalves(FromF32<T>(half(a, 0) - half(b, 0)), FromF32<T>(half(a, 1) - half(b, 1)));
}
template <typename T>
uint32_t LoadPair(const T* p) {
  uint32_t r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void Copy16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void Zero16(void* dst) { std::memset(dst, 0, 16); }

// The vector types and bit operations of the decode GEMVs (kernels/cuda/gemv.cuh).
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint4 __ldcs(const uint4* p) { return *p; }
inline float __uint_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// Byte i of the result: byte (s >> 4i) & 7 of y:x (x the low four), as PTX prmt's default mode.
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i)
    r |= static_cast<uint32_t>((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline void PrefetchL2(const void*) {}
// cp.async: the copy lands at once here; the kernels' barriers order it as on the device.
inline void CpAsync16(void* shared, const void* global) { std::memcpy(shared, global, 16); }
inline void CpAsyncCommit() {}
template <int N>
void CpAsyncWait() {}

namespace emu {

// A reusable barrier for n threads that aborts when they do not all arrive (divergence).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait(const char* where) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "warp emulator: not every thread reached %s (divergence)\n", where);
      std::abort();
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  uint64_t gen_ = 0;
};

// What a lane puts on the table for a collective: a shuffled value or its mma operands.
struct Slot {
  double value;
  uint32_t a[4], b[2];
  const void* row;
};

// Atomics on shared memory: one lock for all (the kernels' histograms are small).
inline std::mutex g_atomics;

// Two sets per warp, used in turn: a lane writes the next set while slower lanes still read
// this one, and cannot come back to this one before they have all reached the next barrier.
struct WarpSlots {
  Slot set[2][32];
};

struct Block {
  explicit Block(int threads) : block(threads), slots((threads + 31) / 32) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<Barrier>(32));
  }
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<WarpSlots> slots;
};

inline Block* g_block = nullptr;
inline thread_local unsigned t_collectives = 0;

inline int Lane() { return static_cast<int>(threadIdx.x) & 31; }
inline int Warp() { return static_cast<int>(threadIdx.x) >> 5; }

// Publishes this lane's slot and returns the warp's slots once every lane has.
inline Slot* Exchange(const Slot& mine, const char* what) {
  Slot* set = g_block->slots[Warp()].set[t_collectives++ & 1];
  set[Lane()] = mine;
  g_block->warps[Warp()]->Wait(what);
  return set;
}

}  // namespace emu

inline void __syncthreads() { emu::g_block->block.Wait("__syncthreads"); }
inline void __syncwarp() { emu::g_block->warps[emu::Warp()]->Wait("__syncwarp"); }
// Grids run one after another here: nothing to wait for (common.cuh's programmatic launch).
inline void PriorGridsDone() {}

template <typename T>
T __shfl_xor_sync(unsigned /*mask: the kernels use full warps*/, T v, int m) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  emu::Slot mine{};
  mine.value = v;
  return static_cast<T>(emu::Exchange(mine, "__shfl_xor_sync")[emu::Lane() ^ m].value);
}

inline int atomicAdd(int* at, int v) {
  std::lock_guard<std::mutex> lock(emu::g_atomics);
  const int old = *at;
  *at = old + v;
  return old;
}

// d += A . B for mma.m16n8k16.row.col with f32 accumulators: A element (row, k) sits in lane
// 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2; B element (k, n) in
// lane 4 n + (k % 8) / 2, register k >= 8, half k % 2; this lane's accumulators are rows
// lane / 4 (+ 8 for the last two) and columns 2 (lane % 4) + {0, 1}.
template <typename T>
void Mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::Slot mine{};
  std::copy(a, a + 4, mine.a);
  std::copy(b, b + 2, mine.b);
  const emu::Slot* all = emu::Exchange(mine, "mma.m16n8k16");
  const auto half = [](uint32_t reg, int k) {
    return ToF32(T{static_cast<uint16_t>(k % 2 == 0 ? reg & 0xffffu : reg >> 16)});
  };
  const int lane = emu::Lane();
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + (i >= 2 ? 8 : 0), col = 2 * (lane % 4) + (i & 1);
    double sum = 0;
    for (int k = 0; k < 16; ++k) {
      const float av =
          half(all[4 * (row % 8) + (k % 8) / 2].a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
      const float bv = half(all[4 * col + (k % 8) / 2].b[k >= 8 ? 1 : 0], k);
      sum += static_cast<double>(av) * bv;
    }
    d[i] = static_cast<float>(d[i] + sum);
  }
}

// ldmatrix.x4 (non-transposed and .trans): lanes 8m..8m+7 give matrix m's row addresses.
inline void LdMatrix(uint32_t (&r)[4], const void* row, bool trans) {
  emu::Slot mine{};
  mine.row = row;
  const emu::Slot* all = emu::Exchange(mine, "ldmatrix");
  const int lane = emu::Lane();
  const auto at = [&](int matrix, int i, int j) {  // element (i, j) of a matrix, as bits
    uint16_t v;
    std::memcpy(&v, static_cast<const uint16_t*>(all[8 * matrix + i].row) + j, sizeof v);
    return static_cast<uint32_t>(v);
  };
  for (int m = 0; m < 4; ++m) {
    const int g = lane / 4, q = lane % 4;
    r[m] = trans ? at(m, 2 * q, g) | (at(m, 2 * q + 1, g) << 16)
                 : at(m, g, 2 * q) | (at(m, g, 2 * q + 1) << 16);
  }
}
inline void LdMatrixX4(uint32_t (&r)[4], const void* row) { LdMatrix(r, row, false); }
inline void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) { LdMatrix(r, row, true); }

// Runs kernel(args...) on every block of `grid` with `threads` threads each.
template <typename... Params, typename... Args>
void EmulateLaunch(EmuDim3 grid, int threads, void (*kernel)(Params...), const Args&... args) {
  for (unsigned z = 0; z < std::max(grid.z, 1u); ++z) {
    for (unsigned y = 0; y < std::max(grid.y, 1u); ++y) {
      for (unsigned x = 0; x < std::max(grid.x, 1u); ++x) {
        emu::Block block(threads);
        emu::g_block = &block;
        blockDim = {static_cast<unsigned>(threads), 1, 1};
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            threadIdx = {static_cast<unsigned>(t), 0, 0};
            blockIdx = {x, y, z};
            emu::t_collectives = 0;
            kernel(args...);
          });
        }
        for (std::thread& th : pool) th.join();
        emu::g_block = nullptr;
      }
    }
  }
}

}  // namespace tgis::kernels::cuda

// Linear's prefill GEMM for bf16 weights on CPUs with AVX512_BF16 (Zen 4 and later, Cooper
// Lake, Sapphire Rapids): out[T, N] = bf16(x)[T, K] @ w[N, K]^T with vdpbf16ps, which multiplies
// pairs of bf16 values exactly and adds both products to an f32 lane: 32 multiply-adds an
// instruction where the f32 GEMM (linear_gemm_avx512.cc) does 16.
//
// x is rounded to bf16 (to nearest even) first: what a bf16 model's matmul takes in transformers
// (its activations are bf16 tensors), in torch's CPU bf16 GEMM and in llama.cpp's BF16 path.
// Decode (T <= kSmallT) rounds x alike (linear_decode_bf16.cc), so that a bf16 model's every
// matmul takes the same x whatever the batch size.
//
// Blocking is the f32 GEMM's: a panel of kNr = 32 weight rows, repacked kPc column pairs at a
// time as [kPc][32] dwords (a dword is one row's bf16 pair (2j, 2j + 1), so the repacking is a
// 32-bit transpose of the rows; 32 KB, L1-resident while every token tile reads it); x packed
// once per call as tiles of kMr tokens, [K / 2][kMr] dwords; a register tile of kMr tokens x 32
// rows, 24 accumulators.
//
// Order: each output is one chain of vdpbf16ps steps over the column pairs in order (blocks
// stored to and reloaded from `out` between them, which is exact), so it depends on its own x
// row only: the same at any T above kSmallT, in any tile, on any number of threads.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int kMr = 12;       // tokens per register tile
constexpr int kNr = 32;       // weight rows per panel
constexpr int64_t kPc = 256;  // column pairs per packed weight block

// x [t, k] (k even) as tiles of kMr tokens, each [k / 2][kMr] dwords of bf16 pairs; tokens past
// t are zeros.
void PackX(const float* x, int64_t t, int64_t k, std::vector<uint32_t>* out) {
  const int64_t kp = k / 2;
  const int64_t tiles = (t + kMr - 1) / kMr;
  out->resize(tiles * kp * kMr);
  uint32_t* p = out->data();
  ParallelFor(tiles, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<uint32_t> row;
    row.resize(kp);
    for (int64_t tile = b; tile < e; ++tile) {
      uint32_t* dst = p + tile * kp * kMr;
      for (int i = 0; i < kMr; ++i) {
        const int64_t token = tile * kMr + i;
        if (token < t) RowToBf16(x + token * k, k, reinterpret_cast<uint16_t*>(row.data()));
        for (int64_t j = 0; j < kp; ++j) dst[j * kMr + i] = token < t ? row[j] : 0;
      }
    }
  });
}

// Column pairs [p0, p0 + pc) of the panel's rows (w: bf16 rows of k columns; rows past `rows`
// are zeros) as [pc][kNr] dwords.
TGIS_AVX512_BF16 void PackPanel(const uint16_t* w, int rows, int64_t k, int64_t p0, int64_t pc,
                                uint32_t* out) {
  const int64_t kp = k / 2;
  const auto* dw = reinterpret_cast<const uint32_t*>(w);
  for (int r0 = 0; r0 < kNr; r0 += 16) {
    int64_t j = 0;
    if (r0 + 16 <= rows) {
      for (; j + 16 <= pc; j += 16) {
        Transpose16(reinterpret_cast<const float*>(dw + r0 * kp + p0 + j), kp,
                    reinterpret_cast<float*>(out + j * kNr + r0), kNr);
      }
    }
    for (int r = r0; r < r0 + 16; ++r) {
      for (int64_t i = j; i < pc; ++i) {
        uint32_t v = 0;
        if (r < rows) std::memcpy(&v, dw + r * kp + p0 + i, sizeof v);
        out[i * kNr + r] = v;
      }
    }
  }
}

// One register tile: out[MR tokens, 32 rows] (+)= xp [pc][kMr] (its first MR tokens) . wp
// [pc][32], pair by pair. `first`: the accumulators start at zero, else from out. Only the rows
// in `m0`/`m1` (the panel's first and second 16) are read and written.
template <int MR>
TGIS_AVX512_BF16 void Tile(const uint32_t* xp, const uint32_t* wp, int64_t pc, float* out,
                           int64_t ldo, __mmask16 m0, __mmask16 m1, bool first) {
  __m512 acc[MR][2];
  StartTile<MR>(acc, out, ldo, m0, m1, first);
  for (int64_t j = 0; j < pc; ++j) {
    const auto w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + j * kNr));
    const auto w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + j * kNr + 16));
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const auto xv =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp[j * kMr + i])));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
    }
  }
  StoreTile<MR>(acc, out, ldo, m0, m1);
}

using TileFn = void (*)(const uint32_t*, const uint32_t*, int64_t, float*, int64_t, __mmask16,
                        __mmask16, bool);
template <int... MR>
constexpr std::array<TileFn, kMr + 1> TileTable(std::integer_sequence<int, MR...>) {
  return {nullptr, &Tile<MR + 1>...};
}
// kTiles[m]: the tile of m tokens.
constexpr std::array<TileFn, kMr + 1> kTiles = TileTable(std::make_integer_sequence<int, kMr>());

}  // namespace

TGIS_AVX512_BF16 void RowToBf16(const float* src, int64_t k, uint16_t* dst) {
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), reinterpret_cast<const __m256i&>(v));
  }
  if (c < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - c)) - 1);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + c));
    _mm256_mask_storeu_epi16(dst + c, m, reinterpret_cast<const __m256i&>(v));
  }
}

bool CpuHasAvx512Bf16() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    // CPUID leaf 7, subleaf 1: EAX bit 5 is AVX512_BF16 (the OS's zmm state is CpuHasAvx512's).
    return CpuHasAvx512() && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) &&
           (eax & (1u << 5)) != 0;
  }();
  return has;
}

void LargeBf16DotGemm(const SmallArgs& a) {
  thread_local std::vector<uint32_t> packed_x;
  PackX(a.x, a.t, a.k, &packed_x);
  const uint32_t* xp = packed_x.data();
  const int64_t kp = a.k / 2;
  const int64_t tiles = (a.t + kMr - 1) / kMr;
  const int64_t panels = (a.n + kNr - 1) / kNr;
  const auto* w = static_cast<const uint16_t*>(a.w);
  ParallelFor(panels, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<uint32_t> wp;
    wp.resize(kPc * kNr);
    for (int64_t panel = b; panel < e; ++panel) {
      const int64_t n0 = panel * kNr;
      const int rows = static_cast<int>(std::min<int64_t>(kNr, a.n - n0));
      const __mmask16 m0 = static_cast<__mmask16>(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(rows <= 16 ? 0 : (1u << (rows - 16)) - 1);
      for (int64_t p0 = 0; p0 < kp; p0 += kPc) {
        const int64_t pc = std::min(kPc, kp - p0);
        PackPanel(w + n0 * a.k, rows, a.k, p0, pc, wp.data());
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t t0 = tile * kMr;
          kTiles[std::min<int64_t>(kMr, a.t - t0)](xp + (tile * kp + p0) * kMr, wp.data(), pc,
                                                   a.out + t0 * a.n + n0, a.n, m0, m1, p0 == 0);
        }
      }
    }
  });
}

}  // namespace tgis::kernels::cpu

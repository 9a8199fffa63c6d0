// 8- and 4-bit codes interleaved 8 rows at a time (CodePanels: made once per weight), and what
// reads them in f32: Linear's exact decode (T <= kSmallT) on AVX2, and the f32 rows exact
// prefill multiplies where the panels are the weight's only copy of its codes. (The
// int8-activation kernels, linear_int8_panels.cc, read them too.)
//
// In a panel vector's dword lane r, code k (nibble or byte) holds row r's code for column
// 8j + k (4-bit) or 4j + k (8-bit) of the block: the codes' own order. Masking code k in place
// (the dword's top one: shifting it down) and converting the dword to f32 gives code *
// 2^(bits * k) exactly, for 8 rows at once; x's column was multiplied by 2^(-bits * k) once per
// call (exact: a power of two), so one FMA applies 8 rows' codes to it. Per 8 weights that is
// a mask, a convert and an FMA, where the row-at-a-time kernel this replaced widened each code
// apart (4-bit: 13 of its ~27 instructions per row and block) and scaled every block of every
// row apart, and was compute-bound at 20-55% of DRAM bandwidth. The block's scale and zero come
// out of its sum:
//   sum_k x[k] * (code[k] - zero) * scale  =  scale * (sum_k x[k] * code[k] - zero * sum_k x[k])
// with 8 rows' constants in one vector. Each block's products go into four chains (the
// columns k % 4), added (0 + 1) + (2 + 3), then scaled into the row's lane in block order: the
// same steps for every token, so a row's result depends on its own x row only (any T, any
// batch, any number of threads), and differs from transformers' dequantize-then-matmul by
// rounding only.
//
// Measured on AMD EPYC Zen 3, 2 threads, against the row-at-a-time kernel (kernels_bench
// --quick [--hot] --t=1): gptq4g32 in cache 10.3-10.5 -> 24.8-25.3 GB/s, from DRAM 9.1-10.0 ->
// 17.9-22.4; int8 (per-row scales) in cache 25.0 -> 43.4, from DRAM 14.7-19.7 -> 24.9-30.9
// (77-95% of the probe). engine_bench on the cpu_bench TinyLlama shape, decode: GPTQ 4-bit g32
// 14.6 -> 27.0 tok/s, --quantize bitsandbytes 15.2-15.8 -> 24.5-27.0.
//
// Where the CPU has AVX-512 (and the kernels may use it), two panels go in one 16-lane vector
// (PairTile16): the same lanes' operations, half the instructions. On Zen 4, which runs those
// as two 256-bit halves and takes 4-bit codes here (linear.cc's UseAvx512), against the 8-lane
// tiles (kernels_bench --shape=5760x2880 gptq4g32, --isa=avx2 against the default): T=1
// 0.447 -> 0.39-0.41 ms (in cache, --quick --hot: 102 -> 113-116 GFLOP/s), T=2 0.60 -> 0.51,
// T=4 1.16 -> 0.74, T=16 4.6 -> 2.64 (with 4-token tiles, which 16 lanes leave room for);
// engine_bench on cpu_bench's GPTQ TinyLlama: decode 29.3-30.1 -> 32.2-34.3 tok/s at batch 1,
// 45.8-46.8 -> 66-73 at batch 16.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/intrinsics_warnings.h"
#include "kernels/cpu/linear_stream.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

constexpr int64_t kBlock = 32;  // columns per weight run step
constexpr int kRows = 8;        // rows per panel: one ymm of f32 lanes

// ---- the layout --------------------------------------------------------------------------

std::atomic<size_t> g_panel_bytes{0};  // held by every weight's panels, for the start-up log

size_t BytesOf(const CodePanels& p) {
  return p.codes.size() + p.block_run.size() * 4 + p.scale_h.size() * 2 + p.zero_b.size() +
         (p.scale.size() + p.zero.size()) * 4;
}

std::shared_ptr<const CodePanels> Build(const QuantizedWeight& q) {
  TGIS_CHECK(!q.codes_only_in_panels,
             "a copy of a weight whose codes were kept only in its panels has neither");
  if ((q.bits != 4 && q.bits != 8) || q.fp8 || !q.codebook.empty() ||
      q.codes.device() != Device::kCpu || !CpuHasAvx2() || !WholeBlockRuns(&q)) {
    return nullptr;
  }
  // Counted while they live.
  std::shared_ptr<CodePanels> p(new CodePanels, [](CodePanels* gone) {
    g_panel_bytes -= BytesOf(*gone);
    delete gone;
  });
  p->bits = q.bits;
  p->blocks = q.stored_in / kBlock;
  p->runs = q.runs();
  p->panels = (q.out + kRows - 1) / kRows;
  const int64_t block_bytes = p->block_bytes();
  const int vectors = q.bits;  // 32-byte vectors per panel and block
  p->codes.assign(p->panels * p->blocks * block_bytes, 0);
  const int32_t* block_run = q.block_run.data<int32_t>();
  for (int64_t b = 0; b < p->blocks; ++b) p->block_run.push_back(block_run[b * kBlock / 8]);
  const int64_t constants = p->panels * p->runs * kRows;
  if (q.compact()) {
    p->scale_h.assign(constants, 0);
    p->zero_b.assign(constants, 0);
  } else {
    p->scale.assign(constants, 0.f);
    p->zero.assign(constants, 0.f);
  }
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes.raw());
  const int64_t row_bytes = q.code_bytes_per_row();
  const int64_t row_block_bytes = kBlock * q.bits / 8;
  ParallelFor(p->panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int r = 0; r < kRows && panel * kRows + r < q.out; ++r) {
        const int64_t n = panel * kRows + r;
        const uint8_t* src = codes + n * row_bytes;
        uint8_t* dst = &p->codes[panel * p->blocks * block_bytes + 4 * r];
        for (int64_t b = 0; b < p->blocks; ++b) {
          for (int j = 0; j < vectors; ++j)
            std::memcpy(dst + b * block_bytes + 32 * j, src + row_block_bytes * b + 4 * j, 4);
        }
        for (int64_t run = 0; run < p->runs; ++run) {
          const int64_t at = (panel * p->runs + run) * kRows + r;
          if (q.compact()) {
            p->scale_h[at] = q.scales.data<uint16_t>()[n * p->runs + run];
            p->zero_b[at] = q.zeros.data<uint8_t>()[n * p->runs + run];
          } else {
            p->scale[at] = q.scales.data<float>()[n * p->runs + run];
            p->zero[at] = q.zeros.data<float>()[n * p->runs + run];
          }
        }
      }
    }
  });
  g_panel_bytes += BytesOf(*p);
  return p;
}

// ---- exact decode ------------------------------------------------------------------------

// Per 8 columns, what x's column is multiplied by: 2^(-bits * k), k its code's place in the
// dword (the top one, shifted down rather than masked, times 1).
template <int B>
TGIS_AVX2 inline __m256 ColumnScales() {
  if constexpr (B == 4) {
    return _mm256_setr_ps(1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f);
  } else {
    return _mm256_setr_ps(1.f, 0x1p-8f, 0x1p-16f, 1.f, 1.f, 0x1p-8f, 0x1p-16f, 1.f);
  }
}

// x as the kernel multiplies it (ColumnScales), and each block's plain sum.
struct ScaledX {
  std::vector<float> x;    // [t, k]
  std::vector<float> sum;  // [t, k / 32]

  template <int B>
  TGIS_AVX2 void Prepare(const float* xs, int64_t t, int64_t k) {
    const int64_t blocks = k / kBlock;
    x.resize(t * k);
    sum.resize(t * blocks);
    const __m256 scales = ColumnScales<B>();
    for (int64_t i = 0; i < t * blocks; ++i) {
      __m256 s = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(xs + i * kBlock + 8 * j);
        s = _mm256_add_ps(s, v);
        _mm256_storeu_ps(&x[i * kBlock + 8 * j], _mm256_mul_ps(v, scales));
      }
      sum[i] = HSum8(s);
    }
  }
};

// Code K of every dword lane as f32: code * 2^(B * K) (the top one: the code itself).
template <int B, int K>
TGIS_AVX2 inline __attribute__((always_inline)) __m256 CodeAt(__m256i v) {
  constexpr int kTop = 32 / B - 1;
  if constexpr (K == kTop) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 32 - B));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(((1 << B) - 1) << (B * K))));
  }
}

// Codes K... of v into c[K]...
template <int B, int... K>
TGIS_AVX2 inline __attribute__((always_inline)) void CodesAt(__m256i v, __m256* c,
                                                             std::integer_sequence<int, K...>) {
  ((c[K] = CodeAt<B, K>(v)), ...);
}

// Column K of P panels' vectors v (their codes K) into their chains K % 4, for TT tokens (x's
// column at xk + t * x_step).
template <int B, int K, int P, int TT>
TGIS_AVX2 inline __attribute__((always_inline)) void Column(const __m256i* v, const float* xk,
                                                            int64_t x_step, __m256 (*acc)[TT][4]) {
  __m256 f[P];
  for (int i = 0; i < P; ++i) f[i] = CodeAt<B, K>(v[i]);
  for (int t = 0; t < TT; ++t) {
    const __m256 x = _mm256_broadcast_ss(xk + t * x_step + K);
    for (int i = 0; i < P; ++i) acc[i][t][K % 4] = _mm256_fmadd_ps(f[i], x, acc[i][t][K % 4]);
  }
}

// Every column of P panels' vectors v (Column, in column order).
template <int B, int P, int TT, int... K>
TGIS_AVX2 inline __attribute__((always_inline)) void Columns(const __m256i* v, const float* xk,
                                                             int64_t x_step, __m256 (*acc)[TT][4],
                                                             std::integer_sequence<int, K...>) {
  (Column<B, K, P, TT>(v, xk, x_step, acc), ...);
}

// Panels [panel, panel + P) against tokens [t0, t0 + TT): P * TT <= 2 keeps the 4 chains of
// each (panel, token) in registers.
template <int B, int P, int TT, bool kCompact>
TGIS_AVX2 void Tile(const SmallArgs& a, const ScaledX& x, const CodePanels& p, int64_t panel,
                    int64_t t0) {
  constexpr int kPer = 32 / B;  // codes per dword
  constexpr int64_t kBlockBytes = 32 * B;
  const int64_t blocks = p.blocks;
  const uint8_t* w[P];
  for (int i = 0; i < P; ++i) w[i] = &p.codes[(panel + i) * blocks * kBlockBytes];
  __m256 out[P][TT];
  for (int i = 0; i < P; ++i)
    for (int t = 0; t < TT; ++t) out[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 acc[P][TT][4];
    for (int i = 0; i < P; ++i)
      for (int t = 0; t < TT; ++t)
        for (int c = 0; c < 4; ++c) acc[i][t][c] = _mm256_setzero_ps();
    for (int i = 0; i < P; ++i) {
      for (int64_t line = 0; line < kBlockBytes; line += 64) {
        PrefetchCodesAhead(w[i] + b * kBlockBytes + line);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) {
      __m256i v[P];
      for (int i = 0; i < P; ++i)
        v[i] =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b * kBlockBytes + 32 * j));
      const float* xk = &x.x[(t0 * blocks + b) * kBlock + kPer * j];
      const int64_t x_step = blocks * kBlock;  // one token to the next
      Columns<B, P, TT>(v, xk, x_step, acc, std::make_integer_sequence<int, kPer>{});
    }
    for (int i = 0; i < P; ++i) {
      __m256 ws, wz;
      PanelRunConstants<kCompact>(p, panel + i, b, &ws, &wz);
      for (int t = 0; t < TT; ++t) {
        const __m256 block = _mm256_add_ps(_mm256_add_ps(acc[i][t][0], acc[i][t][1]),
                                           _mm256_add_ps(acc[i][t][2], acc[i][t][3]));
        const __m256 sum = _mm256_set1_ps(x.sum[(t0 + t) * blocks + b]);
        out[i][t] = _mm256_fmadd_ps(ws, _mm256_fnmadd_ps(wz, sum, block), out[i][t]);
      }
    }
  }
  for (int i = 0; i < P; ++i) StorePanel8(a, (panel + i) * kRows, t0, TT, out[i]);
}

// ---- exact decode, two panels a 16-lane vector (AVX-512) ----------------------------------

template <int B, int K>
TGIS_PANEL_PAIRS inline __attribute__((always_inline)) __m512 CodeAt16(__m512i v) {
  constexpr int kTop = 32 / B - 1;
  if constexpr (K == kTop) {
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 32 - B));
  } else {
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(((1 << B) - 1) << (B * K))));
  }
}

template <int B, int K, int TT>
TGIS_PANEL_PAIRS inline __attribute__((always_inline)) void Column16(__m512i v, const float* xk,
                                                                     int64_t x_step,
                                                                     __m512 (*acc)[4]) {
  const __m512 f = CodeAt16<B, K>(v);
  for (int t = 0; t < TT; ++t) {
    acc[t][K % 4] = _mm512_fmadd_ps(f, _mm512_set1_ps(xk[t * x_step + K]), acc[t][K % 4]);
  }
}

template <int B, int TT, int... K>
TGIS_PANEL_PAIRS inline __attribute__((always_inline)) void Columns16(
    __m512i v, const float* xk, int64_t x_step, __m512 (*acc)[4],
    std::integer_sequence<int, K...>) {
  (Column16<B, K, TT>(v, xk, x_step, acc), ...);
}

// Tile's sums for panels panel and panel + 1 at once, lanes 0-7 the first's rows and 8-15 the
// second's: every lane takes Tile's operations in Tile's order, so the same bits. On Zen 4,
// which runs a 512-bit instruction as two 256-bit halves, half the instructions per weight.
template <int B, int TT, bool kCompact>
TGIS_PANEL_PAIRS void PairTile16(const SmallArgs& a, const ScaledX& x, const CodePanels& p,
                                 int64_t panel, int64_t t0) {
  constexpr int kPer = 32 / B;  // codes per dword
  constexpr int64_t kBlockBytes = 32 * B;
  const int64_t blocks = p.blocks;
  const uint8_t* w0 = &p.codes[panel * blocks * kBlockBytes];
  const uint8_t* w1 = w0 + blocks * kBlockBytes;
  __m512 out[TT];
  for (int t = 0; t < TT; ++t) out[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[TT][4];
    for (int t = 0; t < TT; ++t)
      for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_setzero_ps();
    for (int64_t line = 0; line < kBlockBytes; line += 64) {
      PrefetchCodesAhead(w0 + b * kBlockBytes + line);
      PrefetchCodesAhead(w1 + b * kBlockBytes + line);
    }
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) {
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * kBlockBytes + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * kBlockBytes + 32 * j)), 1);
      const float* xk = &x.x[(t0 * blocks + b) * kBlock + kPer * j];
      Columns16<B, TT>(v, xk, blocks * kBlock, acc, std::make_integer_sequence<int, kPer>{});
    }
    __m512 ws, wz;
    PanelPairRunConstants<kCompact>(p, panel, b, &ws, &wz);
    for (int t = 0; t < TT; ++t) {
      const __m512 block =
          _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]));
      const __m512 sum = _mm512_set1_ps(x.sum[(t0 + t) * blocks + b]);
      out[t] = _mm512_fmadd_ps(ws, _mm512_fnmadd_ps(wz, sum, block), out[t]);
    }
  }
  StorePanelPair(a, panel * kRows, t0, TT, out);
}

template <int B, bool kCompact>
void Panels(const SmallArgs& a, const ScaledX& x, const CodePanels& p, bool avx512) {
  // About 32 KB of codes per parallel chunk, in pairs of panels.
  const int64_t panel_bytes = p.blocks * p.block_bytes();
  const int64_t pairs = (p.panels + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / (panel_bytes * a.t));
  ParallelFor(pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t panel = 2 * pair;
      if (panel + 2 > p.panels) {  // the odd last panel: one token at a time
        for (int64_t t = 0; t < a.t; ++t) Tile<B, 1, 1, kCompact>(a, x, p, panel, t);
        continue;
      }
      int64_t t0 = 0;
      if (avx512) {
        for (; t0 + 4 <= a.t; t0 += 4) PairTile16<B, 4, kCompact>(a, x, p, panel, t0);
        for (; t0 + 2 <= a.t; t0 += 2) PairTile16<B, 2, kCompact>(a, x, p, panel, t0);
        if (t0 < a.t) PairTile16<B, 1, kCompact>(a, x, p, panel, t0);
        continue;
      }
      // Two tokens share each panel's converted codes; one token takes two panels at once.
      for (; t0 + 2 <= a.t; t0 += 2) {
        Tile<B, 1, 2, kCompact>(a, x, p, panel, t0);
        Tile<B, 1, 2, kCompact>(a, x, p, panel + 1, t0);
      }
      if (t0 < a.t) Tile<B, 2, 1, kCompact>(a, x, p, panel, t0);
    }
  });
}

// ---- f32 rows for prefill ----------------------------------------------------------------

// dst rows 0-7 (row stride ld), columns [0, 8): c[k] lane r is row r's weight of column k.
TGIS_AVX2 inline void StoreTransposed8(__m256* c, float* dst, int64_t ld) {
  __m256 u[8], t[8];
  for (int i = 0; i < 4; ++i) {
    u[2 * i] = _mm256_unpacklo_ps(c[2 * i], c[2 * i + 1]);
    u[2 * i + 1] = _mm256_unpackhi_ps(c[2 * i], c[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    t[4 * i] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
    t[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
    t[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
    t[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(t[i], t[4 + i], 0x20));
    _mm256_storeu_ps(dst + (4 + i) * ld, _mm256_permute2f128_ps(t[i], t[4 + i], 0x31));
  }
}

// One panel's 8 rows as f32 into dst rows 0-7 (row stride `ld`): per block and 8 columns, the
// 8 rows' weights of each column, (code - zero) * scale in one vector (the code exact after
// its power of two, code - zero exact, one rounding in the product), then transposed.
template <int B>
TGIS_AVX2 void PanelF32(const CodePanels& p, int64_t panel, float* dst, int64_t ld) {
  constexpr int64_t kBlockBytes = 32 * B;
  const uint8_t* w = &p.codes[panel * p.blocks * kBlockBytes];
  alignas(32) float unscale[8];
  _mm256_store_ps(unscale, ColumnScales<B>());
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256 ws, wz;
    if (p.compact()) {
      PanelRunConstants<true>(p, panel, b, &ws, &wz);
    } else {
      PanelRunConstants<false>(p, panel, b, &ws, &wz);
    }
    // 8 columns at a time: one vector of 4-bit codes, two of 8-bit ones.
    for (int j = 0; j < B; j += B / 4) {
      const uint8_t* wb = w + b * kBlockBytes + 32 * j;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
      __m256 c[8];
      CodesAt<B>(v0, c, std::make_integer_sequence<int, 32 / B>{});
      if constexpr (B == 8) {
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32));
        CodesAt<B>(v1, c + 4, std::make_integer_sequence<int, 4>{});
      }
      for (int k = 0; k < 8; ++k)
        c[k] =
            _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(c[k], _mm256_set1_ps(unscale[k])), wz), ws);
      StoreTransposed8(c, dst + b * kBlock + 8 * (j * 4 / B), ld);
    }
  }
}

}  // namespace

size_t PanelBytes() { return g_panel_bytes.load(); }

const CodePanels* CodePanelsOf(const QuantizedWeight& q) {
  return q.cpu_layout.Panels([&] { return Build(q); });
}

void PanelRowsF32(const CodePanels& p, int64_t n0, int64_t rows, float* dst) {
  const int64_t k = p.blocks * kBlock;
  auto panel_f32 = [&](int64_t panel, float* to) {
    p.bits == 4 ? PanelF32<4>(p, panel, to, k) : PanelF32<8>(p, panel, to, k);
  };
  thread_local std::vector<float> scratch;
  for (int64_t panel = n0 / kRows; panel * kRows < n0 + rows; ++panel) {
    const int64_t first = std::max(n0, panel * kRows);
    const int64_t last = std::min(n0 + rows, (panel + 1) * kRows);
    if (first == panel * kRows && last == first + kRows) {
      panel_f32(panel, dst + (first - n0) * k);
    } else {  // a panel the range cuts: all 8 rows aside, then the ones asked for
      scratch.resize(kRows * k);
      panel_f32(panel, scratch.data());
      std::memcpy(dst + (first - n0) * k, &scratch[(first - panel * kRows) * k],
                  (last - first) * k * sizeof(float));
    }
  }
}

void PanelsExactLinear(const SmallArgs& a, const CodePanels& p, bool avx512) {
  thread_local ScaledX x;
  const ScaledX* shared = &x;  // workers read the calling thread's copy
  if (p.bits == 4) {
    x.Prepare<4>(a.x, a.t, a.k);
    p.compact() ? Panels<4, true>(a, *shared, p, avx512) : Panels<4, false>(a, *shared, p, avx512);
  } else {
    x.Prepare<8>(a.x, a.t, a.k);
    p.compact() ? Panels<8, true>(a, *shared, p, avx512) : Panels<8, false>(a, *shared, p, avx512);
  }
}

}  // namespace tgis::kernels::cpu

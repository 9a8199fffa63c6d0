// Internal to linear_int8_panels.cc and linear_int8_panels_vnni.cc: the panels' kernels, compiled
// once per instruction set. The including file defines TGIS_PANELS_TARGET (the functions'
// target attribute) and TGIS_PANELS_VNNI (1: 4-bit sums through vpdpbusd), includes what
// linear_int8_panels.cc includes, and includes this inside a namespace of its own. The
// integer sums are exact either way, so both give the same bits.
//
// No include guard: each including file takes it once, inside its own namespace.

constexpr int64_t kBlock = 32;  // columns per x scale and per weight run
constexpr int kRows = 8;        // rows per panel: one ymm of int32 or f32 lanes

// The 8 rows' int32 sums of one block against x's codes for tokens [t0, t0 + TT): 4-bit codes
// against SplitEvenOdd's bytes.
template <int TT>
TGIS_PANELS_TARGET inline __attribute__((always_inline)) void BlockSums4(const uint8_t* wb,
                                                                         const int8_t* const* xb,
                                                                         __m256i* dot) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  // With VNNI, vpdpbusd adds each dword's four products into int32 directly: the same exact
  // sums in one instruction per 32 products instead of vpmaddubsw and an int16 add. Its even
  // and odd columns go into two chains (integers: the same sums in any order), so that a
  // token's 8 accumulations are two chains of 4 latencies rather than one of 8.
  __m256i sums[TT];  // VNNI: the even columns' int32 sums; else the int16 pair sums
  [[maybe_unused]] __m256i odd_sums[TT];  // VNNI: the odd columns'
  for (int t = 0; t < TT; ++t) sums[t] = odd_sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
    const __m256i even = _mm256_and_si256(v, low);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
#if TGIS_PANELS_VNNI
      sums[t] = _mm256_dpbusd_epi32(sums[t], even, Broadcast4(xb[t] + 4 * j));
      odd_sums[t] = _mm256_dpbusd_epi32(odd_sums[t], odd, Broadcast4(xb[t] + 16 + 4 * j));
#else
      sums[t] = AddI16(sums[t], _mm256_maddubs_epi16(even, Broadcast4(xb[t] + 4 * j)));
      sums[t] = AddI16(sums[t], _mm256_maddubs_epi16(odd, Broadcast4(xb[t] + 16 + 4 * j)));
#endif
    }
  }
#if TGIS_PANELS_VNNI
  for (int t = 0; t < TT; ++t) dot[t] = AddI32(sums[t], odd_sums[t]);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < TT; ++t) dot[t] = _mm256_madd_epi16(sums[t], ones);
#endif
}

// 8-bit codes against x's codes in column order. Vector j's dword lane r holds row r's columns
// 4j to 4j + 3, multiplied as (code - 128): its magnitude (unsigned) against x's codes carrying
// its sign, so that no pair sum saturates (at most 2 * 128 * 127); 128 * sum(xq) is added back
// by the caller's zero term (exact).
template <int TT>
TGIS_PANELS_TARGET inline __attribute__((always_inline)) void BlockSums8(const uint8_t* wb,
                                                                         const int8_t* const* xb,
                                                                         __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < TT; ++t) dot[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m256i centered =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j)),
                         _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i magnitude = _mm256_abs_epi8(centered);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const __m256i pairs =
          _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(Broadcast4(xb[t] + 4 * j), centered));
      dot[t] = AddI32(dot[t], _mm256_madd_epi16(pairs, ones));
    }
  }
}

// Tokens [t0, t0 + TT) against panels [panel, panel + P) (8 rows each), x's codes as the
// panels' bits want them. Each panel's steps are the same whatever P and TT.
template <int P, int TT, bool kCompact, int kBits>
TGIS_PANELS_TARGET void Tile(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs,
                             const CodePanels& p, int64_t panel, int64_t t0) {
  const int64_t blocks = p.blocks;
  const int64_t block_bytes = p.block_bytes();
  const uint8_t* w = &p.codes[panel * blocks * block_bytes];
  __m256 acc[P][TT];
  for (int i = 0; i < P; ++i)
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb[TT];
    for (int t = 0; t < TT; ++t) xb[t] = xs + ((t0 + t) * blocks + b) * kBlock;
#pragma GCC unroll 2
    for (int i = 0; i < P; ++i) {
      const uint8_t* wb = w + (i * blocks + b) * block_bytes;
      // Decode streams the codes from memory; a GEMM's panel stays in cache for every token
      // tile (prefetching there cost 4-7%: kernels_bench --quick --hot --t=512). On Zen 3,
      // 2048 bytes ahead did a little better than 4096 for 8-bit codes and no worse for 4-bit
      // (kernels_bench --quick --t=1 --int8-activations int8 gptq4g32, alternated).
      if (a.t <= kSmallT) {
        for (int64_t line = 0; line < block_bytes; line += 64) PrefetchCodesAhead(wb + line, 2048);
      }
      __m256i dot[TT];
      if constexpr (kBits == 4) {
        BlockSums4<TT>(wb, xb, dot);
      } else {
        BlockSums8<TT>(wb, xb, dot);
      }
      __m256 ws, wz;
      PanelRunConstants<kCompact>(p, panel + i, b, &ws, &wz);
      if constexpr (kBits == 8) wz = _mm256_sub_ps(wz, _mm256_set1_ps(128.f));  // exact
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const int64_t at = (t0 + t) * blocks + b;
        const __m256 sum = _mm256_set1_ps(x.sum[at]);
        const __m256 exact = _mm256_fnmadd_ps(wz, sum, _mm256_cvtepi32_ps(dot[t]));
        acc[i][t] =
            _mm256_fmadd_ps(exact, _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[at])), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < P; ++i) StorePanel8(a, (panel + i) * kRows, t0, TT, acc[i]);
}

#if TGIS_PANELS_VNNI
// Tile for 4-bit codes of panels panel and panel + 1 at once in 16-lane vectors (lanes 0-7 the
// first's rows, 8-15 the second's): the same exact integers and the same f32 steps a lane, so
// Tile's bits, in half the instructions where 512-bit ones run as two halves (Zen 4).
template <int TT, bool kCompact>
TGIS_PANELS_TARGET void PairTile16(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs,
                                   const CodePanels& p, int64_t panel, int64_t t0) {
  const int64_t blocks = p.blocks;
  const int64_t block_bytes = p.block_bytes();
  const uint8_t* w0 = &p.codes[panel * blocks * block_bytes];
  const uint8_t* w1 = w0 + blocks * block_bytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb[TT];
    for (int t = 0; t < TT; ++t) xb[t] = xs + ((t0 + t) * blocks + b) * kBlock;
    const uint8_t* wb0 = w0 + b * block_bytes;
    const uint8_t* wb1 = w1 + b * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) {
      PrefetchCodesAhead(wb0 + line, 2048);
      PrefetchCodesAhead(wb1 + line, 2048);
    }
    __m512i sums[TT], odd_sums[TT];
    for (int t = 0; t < TT; ++t) sums[t] = odd_sums[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb0 + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb1 + 32 * j)), 1);
      const __m512i even = _mm512_and_si512(v, low);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        int32_t e, o;
        std::memcpy(&e, xb[t] + 4 * j, 4);
        std::memcpy(&o, xb[t] + 16 + 4 * j, 4);
        sums[t] = _mm512_dpbusd_epi32(sums[t], even, _mm512_set1_epi32(e));
        odd_sums[t] = _mm512_dpbusd_epi32(odd_sums[t], odd, _mm512_set1_epi32(o));
      }
    }
    __m512 ws, wz;
    PanelPairRunConstants<kCompact>(p, panel, b, &ws, &wz);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const int64_t at = (t0 + t) * blocks + b;
      const __m512 sum = _mm512_set1_ps(x.sum[at]);
      const __m512i dot = _mm512_add_epi32(sums[t], odd_sums[t]);
      const __m512 exact = _mm512_fnmadd_ps(wz, sum, _mm512_cvtepi32_ps(dot));
      acc[t] = _mm512_fmadd_ps(exact, _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[at])), acc[t]);
    }
  }
  StorePanelPair(a, panel * kRows, t0, TT, acc);
}
#endif

template <bool kCompact, int kBits>
void Panels(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs, const CodePanels& p) {
  // About 64 KB of codes per parallel chunk in decode; single panels when every one is a
  // GEMM's worth of work.
  const int64_t panel_bytes = p.blocks * p.block_bytes();
  const int64_t grain =
      a.t > kSmallT ? 1 : std::max<int64_t>(1, (int64_t{64} << 10) / (panel_bytes * a.t));
  ParallelFor(p.panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end;) {
#if TGIS_PANELS_VNNI
      if (kBits == 4 && a.t > 4 && panel + 2 <= end) {
        int64_t t0 = 0;
        for (; t0 + 4 <= a.t; t0 += 4) PairTile16<4, kCompact>(a, x, xs, p, panel, t0);
        for (; t0 + 2 <= a.t; t0 += 2) PairTile16<2, kCompact>(a, x, xs, p, panel, t0);
        if (t0 < a.t) PairTile16<1, kCompact>(a, x, xs, p, panel, t0);
        panel += 2;
        continue;
      }
#endif
      // 8-bit codes: two panels at once where one token is left (decode's T = 1), two streams
      // of codes (Zen 3, kernels_bench --quick --t=1 --int8-activations, alternated: int8
      // 29-31 -> 32-34 GB/s; 4-bit codes lost as much that way: gptq4g32 33-37 -> 28-33).
      const int pair = kBits == 8 && panel + 2 <= end ? 2 : 1;
      for (int i = 0; i < pair; ++i) {
        int64_t t0 = 0;
        for (; t0 + 4 <= a.t; t0 += 4) Tile<1, 4, kCompact, kBits>(a, x, xs, p, panel + i, t0);
        if (t0 + 2 <= a.t) Tile<1, 2, kCompact, kBits>(a, x, xs, p, panel + i, t0);
      }
      if (a.t % 2 == 1) {
        pair == 2 ? Tile<2, 1, kCompact, kBits>(a, x, xs, p, panel, a.t - 1)
                  : Tile<1, 1, kCompact, kBits>(a, x, xs, p, panel, a.t - 1);
      }
      panel += pair;
    }
  });
}

// Int8PanelsLinear on x's codes as the panels' bits want them (`xs`).
inline void RunPanels(const SmallArgs& a, const Int8Blocks& x, const int8_t* xs,
                      const CodePanels& p) {
  if (p.bits == 8) {
    return p.compact() ? Panels<true, 8>(a, x, xs, p) : Panels<false, 8>(a, x, xs, p);
  }
  p.compact() ? Panels<true, 4>(a, x, xs, p) : Panels<false, 4>(a, x, xs, p);
}

#include "kernels/quantized.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "kernels/check.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels {

namespace {

constexpr int64_t kBlock = 8;  // stored columns per block: one scale and zero per row

uint8_t CodeAt(const QuantizedWeight& q, const uint8_t* row, int64_t j) {
  if (q.bits == 8) return row[j];
  return (row[j / 2] >> (4 * (j % 2))) & 0xF;
}

// Whether every scale is an f16 value (NaN never is) and every zero an integer in [0, 255].
bool CompactExactly(const std::vector<float>& scales, const std::vector<float>& zeros) {
  for (float s : scales) {
    if (!(F16ToF32(F32ToF16(s)) == s)) return false;
  }
  for (float z : zeros) {
    if (!(z >= 0.f && z <= 255.f && z == std::floor(z))) return false;
  }
  return true;
}

}  // namespace

float RunScale(const QuantizedWeight& q, int64_t n, int64_t r) {
  const int64_t i = n * q.runs() + r;
  return q.compact() ? F16ToF32(q.scales.data<uint16_t>()[i]) : q.scales.data<float>()[i];
}

float RunZero(const QuantizedWeight& q, int64_t n, int64_t r) {
  const int64_t i = n * q.runs() + r;
  return q.compact() ? static_cast<float>(q.zeros.data<uint8_t>()[i]) : q.zeros.data<float>()[i];
}

QuantizedWeight ExpandRunConstants(const QuantizedWeight& q) {
  TGIS_CHECK(!q.codes_only_in_panels,
             "ExpandRunConstants: the weight's constants are only in the CPU panels");
  if (!q.compact()) return q;
  TGIS_CHECK(q.scales.device() == Device::kCpu, "ExpandRunConstants runs on the CPU");
  QuantizedWeight e = q;
  const int64_t runs = q.runs();
  std::vector<float> s(q.out * runs), z(q.out * runs);
  for (int64_t n = 0; n < q.out; ++n) {
    for (int64_t r = 0; r < runs; ++r) {
      s[n * runs + r] = RunScale(q, n, r);
      z[n * runs + r] = RunZero(q, n, r);
    }
  }
  e.scales = Tensor::FromVector(s, {q.out, runs});
  e.zeros = Tensor::FromVector(z, {q.out, runs});
  return e;
}

QuantizedWeight BuildQuantized(int bits, int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                               const std::vector<int32_t>& group, int64_t groups,
                               const std::vector<float>& scales, const std::vector<float>& zeros) {
  TGIS_CHECK(bits == 4 || bits == 8, "BuildQuantized: %d bits (4 or 8)", bits);
  TGIS_CHECK(static_cast<int64_t>(codes.size()) == out * in &&
                 static_cast<int64_t>(group.size()) == in &&
                 static_cast<int64_t>(scales.size()) == out * groups &&
                 static_cast<int64_t>(zeros.size()) == out * groups,
             "BuildQuantized: sizes disagree");
  std::vector<int32_t> order(in);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return group[a] < group[b]; });
  // Stored columns, run by run, each run padded to a whole number of blocks.
  std::vector<int32_t> stored;
  std::vector<int32_t> run_group;
  std::vector<int32_t> block_run;
  for (int64_t i = 0; i < in;) {
    const int32_t g = group[order[i]];
    TGIS_CHECK(g >= 0 && g < groups, "BuildQuantized: column %d has group %d of %lld", order[i], g,
               static_cast<long long>(groups));
    int64_t j = i;
    while (j < in && group[order[j]] == g) stored.push_back(order[j++]);
    while (stored.size() % kBlock != 0) stored.push_back(-1);
    const int32_t run = static_cast<int32_t>(run_group.size());
    run_group.push_back(g);
    block_run.resize(stored.size() / kBlock, run);
    i = j;
  }
  QuantizedWeight q;
  q.bits = bits;
  q.out = out;
  q.in = in;
  q.stored_in = static_cast<int64_t>(stored.size());
  bool identity = q.stored_in == in;
  for (int64_t j = 0; identity && j < in; ++j) identity = stored[j] == j;
  if (!identity) q.gather = Tensor::FromVector(stored, {q.stored_in});
  if (q.stored_in > 0) q.block_run = Tensor::FromVector(block_run, {q.stored_in / kBlock});

  const int64_t runs = static_cast<int64_t>(run_group.size());
  std::vector<float> s(out * runs), z(out * runs);
  for (int64_t n = 0; n < out; ++n) {
    for (int64_t r = 0; r < runs; ++r) {
      s[n * runs + r] = scales[n * groups + run_group[r]];
      z[n * runs + r] = zeros[n * groups + run_group[r]];
    }
  }
  if (bits == 4 && CompactExactly(s, z)) {
    std::vector<uint16_t> hs(s.size());
    std::vector<int8_t> bz(z.size());
    for (size_t i = 0; i < s.size(); ++i) {
      hs[i] = F32ToF16(s[i]);
      bz[i] = static_cast<int8_t>(static_cast<uint8_t>(z[i]));
    }
    q.scales = Tensor::FromHost(hs.data(), {out, runs}, DType::kF16);
    q.zeros = Tensor::FromHost(bz.data(), {out, runs}, DType::kI8);
  } else {
    q.scales = Tensor::FromVector(s, {out, runs});
    q.zeros = Tensor::FromVector(z, {out, runs});
  }
  q.codes = Tensor::Zeros({out, std::max<int64_t>(q.code_bytes_per_row(), 1)}, DType::kI8);
  // Rows over the CPU threads, the codes' range checked once per row, and without a gather a
  // plain copy or pairing: at load this packing was a fifth of a GPTQ checkpoint's time.
  cpu::ParallelFor(out, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      uint8_t* row = q.codes.data<uint8_t>() + n * q.codes.dim(1);
      const uint8_t* src = codes.data() + n * in;
      uint8_t seen = 0;  // every code's bits or'ed
      if (identity && bits == 8) {
        if (in > 0) std::memcpy(row, src, in);  // src is null for a zero-width weight
        for (int64_t k = 0; k < in; ++k) seen |= src[k];
      } else if (identity) {
        for (int64_t k = 0; k + 1 < in; k += 2) {
          row[k / 2] = static_cast<uint8_t>(src[k] | (src[k + 1] << 4));
          seen |= src[k] | src[k + 1];
        }
        if (in % 2 == 1) {
          row[in / 2] = src[in - 1];
          seen |= src[in - 1];
        }
      } else {
        for (int64_t j = 0; j < q.stored_in; ++j) {
          if (stored[j] < 0) continue;  // padding: x reads 0 there
          const uint8_t c = src[stored[j]];
          seen |= c;
          if (bits == 8) {
            row[j] = c;
          } else {
            row[j / 2] |= static_cast<uint8_t>(c << (4 * (j % 2)));
          }
        }
      }
      TGIS_CHECK((seen >> bits) == 0, "BuildQuantized: row %lld has a code beyond %d bits",
                 static_cast<long long>(n), bits);
    }
  });
  return q;
}

bool QuantizedCompatible(const QuantizedWeight& a, const QuantizedWeight& b) {
  auto same = [](const Tensor& x, const Tensor& y) {
    if (x.defined() != y.defined()) return false;
    return !x.defined() ||
           (x.numel() == y.numel() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0);
  };
  return a.bits == b.bits && a.fp8 == b.fp8 && a.codebook == b.codebook && a.in == b.in &&
         a.stored_in == b.stored_in && a.runs() == b.runs() && same(a.gather, b.gather) &&
         same(a.block_run, b.block_run);
}

QuantizedWeight ConcatQuantizedRows(const std::vector<const QuantizedWeight*>& parts) {
  for (const QuantizedWeight* p : parts) {
    TGIS_CHECK(!p->codes_only_in_panels,
               "ConcatQuantizedRows: a part's codes are only in the CPU panels");
  }
  TGIS_CHECK(!parts.empty(), "ConcatQuantizedRows: no parts");
  int64_t out = 0;
  bool same_form = true;
  for (const QuantizedWeight* p : parts) {
    TGIS_CHECK(QuantizedCompatible(*parts[0], *p), "ConcatQuantizedRows: incompatible parts");
    TGIS_CHECK(p->codes.device() == Device::kCpu, "ConcatQuantizedRows runs on the CPU");
    out += p->out;
    same_form &= p->compact() == parts[0]->compact();
  }
  // Parts whose run constants differ in form (one part's scales are not all f16 values) are
  // stacked in f32.
  std::vector<QuantizedWeight> widened;
  std::vector<const QuantizedWeight*> use = parts;
  if (!same_form) {
    widened.reserve(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      widened.push_back(ExpandRunConstants(*parts[i]));
      use[i] = &widened.back();
    }
  }
  QuantizedWeight q = *use[0];
  auto stack = [&](auto member) {
    const Tensor& first = use[0]->*member;
    Tensor t = Tensor::Empty({out, first.dim(1)}, first.dtype());
    char* dst = static_cast<char*>(t.raw());
    for (const QuantizedWeight* p : use) {
      const Tensor& src = p->*member;
      std::memcpy(dst, src.raw(), src.nbytes());
      dst += src.nbytes();
    }
    return t;
  };
  q.out = out;
  q.codes = stack(&QuantizedWeight::codes);
  q.scales = stack(&QuantizedWeight::scales);
  q.zeros = stack(&QuantizedWeight::zeros);
  return q;
}

Tensor Dequantize(const QuantizedWeight& q) {
  TGIS_CHECK(q.codes.device() == Device::kCpu, "Dequantize runs on the CPU");
  TGIS_CHECK(!q.codes_only_in_panels, "Dequantize: the weight's codes are only in the CPU panels");
  Tensor w = Tensor::Zeros({q.out, q.in}, DType::kF32);
  for (int64_t n = 0; n < q.out; ++n) {
    const uint8_t* row = q.codes.data<uint8_t>() + n * q.codes.dim(1);
    for (int64_t j = 0; j < q.stored_in; ++j) {
      const int64_t col = q.gather.defined() ? q.gather.data<int32_t>()[j] : j;
      if (col < 0) continue;
      const int64_t r = q.block_run.data<int32_t>()[j / kBlock];
      const uint8_t c = CodeAt(q, row, j);
      const float code = !q.codebook.empty() ? q.codebook[c]
                         : q.fp8             ? Fp8E4M3ToF32(c)
                                             : static_cast<float>(c);
      w.data<float>()[n * q.in + col] = (code - RunZero(q, n, r)) * RunScale(q, n, r);
    }
  }
  return w;
}

namespace {

// A row's largest |w|; false where the row holds a NaN or an infinity (it has no int8 form).
bool FiniteRowAbsmax(const float* row, int64_t in, float* absmax) {
  float m = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < in; ++k) {
    const float a = std::fabs(row[k]);
    m = std::max(m, a);
    finite &= a <= std::numeric_limits<float>::max();
  }
  *absmax = m;
  return finite;
}

// A code of a finite row for a finite scale > 0, rounded as std::nearbyint rounds (half to
// even) without its libm call: |w / scale| <= 127 (plus rounding) is below 2^22, where adding
// and subtracting 1.5 * 2^23 rounds to an integer, ties to even (1.5 * 2^23 is even, so the
// sum's parity is the result's).
inline uint8_t Int8Code(float w, float scale) {
  const float c = (w / scale + 0x1.8p23f) - 0x1.8p23f;
  return static_cast<uint8_t>(static_cast<int32_t>(std::clamp(c, -127.f, 127.f)) + 128);
}

#if defined(__x86_64__)
// The two loops above, 8 and 32 lanes at a time (at load they were a fifth of a bitsandbytes
// start, scalar); the same divisions and roundings, so the same codes.
__attribute__((target("avx2"))) bool FiniteRowAbsmaxAvx2(const float* row, int64_t in,
                                                         float* absmax) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 m = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude);
    m = _mm256_max_ps(m, a);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, largest, _CMP_LE_OQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float tail = 0.f;
  const bool tail_finite = FiniteRowAbsmax(row + k, in - k, &tail);
  *absmax = std::max(tail, *std::max_element(lanes, lanes + 8));
  return tail_finite && _mm256_movemask_ps(finite) == 0xFF;
}

// Eight codes, as Int8Code makes them, as int32 lanes.
__attribute__((target("avx2"), always_inline)) inline __m256i Int8Codes8(const float* p,
                                                                         __m256 scale) {
  const __m256 magic = _mm256_set1_ps(0x1.8p23f);
  __m256 c = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(p), scale), magic), magic);
  c = _mm256_min_ps(_mm256_max_ps(c, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  return _mm256_add_epi32(_mm256_cvttps_epi32(c), _mm256_set1_epi32(128));
}

__attribute__((target("avx2"))) void Int8CodesAvx2(const float* row, int64_t in, float scale,
                                                   uint8_t* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  // packs and packus interleave 128-bit lanes: dwords 0 4 1 5 2 6 3 7 put them back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    const __m256i ab = _mm256_packs_epi32(Int8Codes8(row + k, s), Int8Codes8(row + k + 8, s));
    const __m256i cd = _mm256_packs_epi32(Int8Codes8(row + k + 16, s), Int8Codes8(row + k + 24, s));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), bytes);
  }
  for (; k < in; ++k) dst[k] = Int8Code(row[k], scale);
}
#endif

}  // namespace

namespace {

// *first = min(*first, row), from any thread: the first row that failed, whichever found it.
void KeepFirstRow(std::atomic<int64_t>* first, int64_t row) {
  int64_t seen = first->load();
  while (row < seen && !first->compare_exchange_weak(seen, row)) {
  }
}

}  // namespace

QuantizedWeight QuantizeInt8Rows(const Tensor& w, const std::vector<float>* row_absmax,
                                 int64_t* nonfinite_row) {
  TGIS_CHECK(w.rank() == 2 && w.device() == Device::kCpu && !w.quantized(),
             "QuantizeInt8Rows: w must be a dense [out, in] CPU tensor");
  const Tensor f = w.dtype() == DType::kF32 ? w : w.To(DType::kF32);
  const int64_t out = f.dim(0), in = f.dim(1);
  std::vector<uint8_t> codes(out * in);
  std::vector<float> scales(out), zeros(out, 128.f);
  if (row_absmax != nullptr) {
    TGIS_CHECK(static_cast<int64_t>(row_absmax->size()) == out,
               "QuantizeInt8Rows: row_absmax does not cover the rows");
  }
  // Rows over the CPU threads (at load, one thread took most of a bitsandbytes start).
  const bool avx2 = cpu::UseAvx2Kernels();
  std::atomic<int64_t> bad{out};  // the first row that is not finite (out: none)
  cpu::ParallelFor(out, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      const float* row = f.data<float>() + n * in;
      float absmax = 0.f;
#if defined(__x86_64__)
      bool finite =
          avx2 ? FiniteRowAbsmaxAvx2(row, in, &absmax) : FiniteRowAbsmax(row, in, &absmax);
#else
      bool finite = FiniteRowAbsmax(row, in, &absmax);
#endif
      if (row_absmax != nullptr) {
        TGIS_CHECK((*row_absmax)[n] >= absmax,
                   "QuantizeInt8Rows: row_absmax is below a row's own absmax");
        absmax = (*row_absmax)[n];
      }
      const float scale = absmax / 127.f;
      scales[n] = scale;
      uint8_t* dst = codes.data() + n * in;  // (in may be 0: no element to reference)
      if (!finite || !(scale <= std::numeric_limits<float>::max())) {
        TGIS_CHECK(nonfinite_row != nullptr,
                   "QuantizeInt8Rows: row %lld holds a NaN or an infinity",
                   static_cast<long long>(n));
        KeepFirstRow(&bad, n);
        scales[n] = 0.f;  // the row's codes stay 0: a weight the caller discards
        continue;
      }
      if (scale == 0.f) {  // an all-zero row (or one below 127 times the least float): zeros
        std::fill(dst, dst + in, uint8_t{128});
        continue;
      }
#if defined(__x86_64__)
      if (avx2) {
        Int8CodesAvx2(row, in, scale, dst);
        continue;
      }
#endif
      for (int64_t k = 0; k < in; ++k) dst[k] = Int8Code(row[k], scale);
    }
  });
  if (nonfinite_row != nullptr && bad.load() < out) *nonfinite_row = bad.load();
  return BuildQuantized(8, out, in, codes, std::vector<int32_t>(in, 0), 1, scales, zeros);
}

bool QuantizeBlocks4(const Tensor& w, int64_t block, const std::vector<float>& table,
                     std::vector<uint8_t>* codes, std::vector<float>* absmax,
                     int64_t* nonfinite_row) {
  TGIS_CHECK(w.rank() == 2 && w.device() == Device::kCpu && !w.quantized(),
             "QuantizeBlocks4: w must be a dense [out, in] CPU tensor");
  TGIS_CHECK(table.size() == 16 && block > 0 && w.dim(1) % block == 0,
             "QuantizeBlocks4: 16 table values and rows of whole blocks");
  const Tensor f = w.dtype() == DType::kF32 ? w : w.To(DType::kF32);
  const int64_t out = f.dim(0), in = f.dim(1), groups = in / block;
  // The code of x is the number of midpoints of the sorted table below it (lower_bound's
  // index), mapped back to the table's own order: 15 compares without a branch.
  std::array<int, 16> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return table[a] < table[b]; });
  float mid[15];
  for (int i = 0; i < 15; ++i) mid[i] = (table[order[i]] + table[order[i + 1]]) / 2.f;
  codes->assign(out * in, 0);
  absmax->assign(out * groups, 0.f);
  std::atomic<int64_t> bad{out};  // the first row that is not finite (out: none)
  cpu::ParallelFor(out, 4, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = f.data<float>() + n * in + g * block;
        float m = 0.f;
        bool finite = true;
        for (int64_t k = 0; k < block; ++k) {
          finite &= std::isfinite(v[k]);
          m = std::max(m, std::fabs(v[k]));
        }
        if (!finite) {
          KeepFirstRow(&bad, n);
          break;
        }
        (*absmax)[n * groups + g] = m;
        const float inv = 1.f / std::max(m, 1e-38f);
        uint8_t* dst = codes->data() + n * in + g * block;
        for (int64_t k = 0; k < block; ++k) {
          const float x = std::clamp(v[k] * inv, -1.f, 1.f);
          int below = 0;
          for (int i = 0; i < 15; ++i) below += mid[i] < x;
          dst[k] = static_cast<uint8_t>(order[below]);
        }
      }
    }
  });
  if (bad.load() < out) {
    *nonfinite_row = bad.load();
    return false;
  }
  return true;
}

QuantizedWeight BuildFp8Rows(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                             const std::vector<float>& row_scales) {
  return BuildFp8(out, in, codes, std::vector<int32_t>(in, 0), 1, row_scales);
}

namespace {

// Codes whose values (fp8, a table) carry their sign: zeros 0, a scale per row and group.
QuantizedWeight BuildWithoutZeros(const char* what, int bits, int64_t out, int64_t in,
                                  const std::vector<uint8_t>& codes,
                                  const std::vector<int32_t>& group, int64_t groups,
                                  const std::vector<float>& scales) {
  TGIS_CHECK(static_cast<int64_t>(scales.size()) == out * groups,
             "%s: %lld scales for %lld rows of %lld groups", what,
             static_cast<long long>(scales.size()), static_cast<long long>(out),
             static_cast<long long>(groups));
  return BuildQuantized(bits, out, in, codes, group, groups, scales,
                        std::vector<float>(out * groups, 0.f));
}

}  // namespace

QuantizedWeight BuildFp8(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                         const std::vector<int32_t>& group, int64_t groups,
                         const std::vector<float>& scales) {
  QuantizedWeight q = BuildWithoutZeros("BuildFp8", 8, out, in, codes, group, groups, scales);
  q.fp8 = true;
  return q;
}

QuantizedWeight BuildCodebook4(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                               const std::vector<int32_t>& group, int64_t groups,
                               const std::vector<float>& scales,
                               const std::vector<float>& codebook) {
  TGIS_CHECK(codebook.size() == 16, "BuildCodebook4: %zu values for 4-bit codes", codebook.size());
  QuantizedWeight q = BuildWithoutZeros("BuildCodebook4", 4, out, in, codes, group, groups, scales);
  q.codebook = codebook;
  return q;
}

void FindRunFacts(QuantizedWeight* q) {
  if (!q->block_run.defined() || q->block_run.device() != Device::kCpu || !q->zeros.defined() ||
      q->zeros.device() != Device::kCpu || q->zeros.dtype() != DType::kF32) {
    return;
  }
  const int32_t* run = q->block_run.data<int32_t>();
  int64_t align = 128;
  for (int64_t b = 1; b < q->block_run.numel(); ++b) {
    if (run[b] == run[b - 1]) continue;
    while ((8 * b) % align != 0) align /= 2;
  }
  q->run_alignment = std::max<int64_t>(align, 8);
  const float* z = q->zeros.data<float>();
  int64_t most = 0;
  for (int64_t i = 0; i < q->zeros.numel(); ++i) {
    if (!(z[i] >= 0) || z[i] != std::floor(z[i]) || z[i] > 65535) {
      most = -1;
      break;
    }
    most = std::max(most, static_cast<int64_t>(z[i]));
  }
  q->max_zero = most;
}

QuantizedWeight QuantizedToDevice(const QuantizedWeight& q, Device device) {
  TGIS_CHECK(!q.codes_only_in_panels || device == Device::kCpu,
             "QuantizedToDevice: the weight's codes are only in the CPU panels");
  QuantizedWeight d = device == Device::kCpu ? q : ExpandRunConstants(q);
  if (device != Device::kCpu) FindRunFacts(&d);
  for (Tensor* t : {&d.codes, &d.scales, &d.zeros, &d.block_run, &d.gather}) {
    if (t->defined()) *t = t->ToDevice(device);
  }
  return d;
}

}  // namespace tgis::kernels

// Every op in kernels/ops.h against naive double-precision references written here (plain
// loops, not the kernels' code). One parametrized suite over device x dtype: the dtype is the
// storage type of the op's parameters (Linear/Embedding/norm weights, biases, the KV cache) and,
// on CUDA, of the activations too. CUDA cases report themselves skipped until CUDA is built and
// a GPU is present.
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/linear_stream.h"  // the exact panels' two widths, below
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"
#include "kernels/quantized.h"
#include "kernels/relative_position.h"
#include "kernels/tensor.h"
#ifdef TGIS_WITH_CUDA
#include "kernels/cuda_ops.h"
#endif

namespace tgis::kernels {
namespace {

struct OpsParam {
  Device device;
  DType dtype;
};

void PrintTo(const OpsParam& p, std::ostream* os) {
  *os << (p.device == Device::kCpu ? "cpu" : "cuda") << "/" << DTypeName(p.dtype);
}

std::string ParamName(const ::testing::TestParamInfo<OpsParam>& info) {
  std::string d = info.param.device == Device::kCpu ? "Cpu" : "Cuda";
  switch (info.param.dtype) {
    case DType::kF32:
      return d + "_F32";
    case DType::kBF16:
      return d + "_BF16";
    case DType::kF16:
      return d + "_F16";
    default:
      return d + "_Other";
  }
}

// Relative tolerance for results computed with `dtype` storage/arithmetic:
//  - f32: 24-bit significand (eps 6e-8); a few hundred accumulated roundings stay ~1e-5.
//  - bf16: 8 significant bits (eps 2^-8 = 3.9e-3): ~1e-2 relative.
//  - f16: 11 significant bits (eps 2^-11 = 4.9e-4): ~1e-3 relative (2e-3 for headroom).
// The references below use the parameters as stored (rounded to the dtype), so what is left is
// the arithmetic of the device: f32 on the CPU, the dtype itself for CUDA activations.
double RelTol(DType t) {
  switch (t) {
    case DType::kBF16:
      return 1e-2;
    case DType::kF16:
      return 2e-3;
    default:
      return 1e-5;
  }
}

float RoundTo(DType t, float v) {
  switch (t) {
    case DType::kBF16:
      return Bf16ToF32(F32ToBf16(v));
    case DType::kF16:
      return F16ToF32(F32ToF16(v));
    default:
      return v;
  }
}

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |got - ref| <= tol * (scale + |ref|) elementwise, where `scale` is the size of the terms that
// made ref (e.g. sum |w_i x_i| for a dot product), so cancellation does not demand the
// impossible.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& ref,
                 const std::vector<double>& scale, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double s = scale.empty() ? 0.0 : scale[i];
    const double err = std::fabs(got[i] - ref[i]);
    const bool ok =
        (std::isinf(ref[i]) && got[i] == ref[i]) || err <= tol * (s + std::fabs(ref[i]));
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << ref[i]
                    << " (err " << err << ", allowed " << tol * (s + std::fabs(ref[i])) << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off";
}

class OpsTest : public ::testing::TestWithParam<OpsParam> {
 public:
  void SetUp() override {
    if (GetParam().device == Device::kCuda) {
#ifdef TGIS_WITH_CUDA
      if (cuda::DeviceCount() == 0) GTEST_SKIP() << "CUDA not built/available";
#else
      GTEST_SKIP() << "CUDA not built/available";
#endif
    }
  }
  void TearDown() override { cpu::SetIsaForTesting(cpu::Isa::kAuto); }

  // The Linear code paths to check: on the CPU every one this machine can run, by name.
  std::vector<std::pair<cpu::Isa, std::string>> Isas() const {
    if (device() != Device::kCpu) return {{cpu::Isa::kAuto, "cuda"}};
    std::vector<std::pair<cpu::Isa, std::string>> isas = {{cpu::Isa::kScalar, "scalar"}};
    if (cpu::IsaAvailable(cpu::Isa::kAvx2)) isas.emplace_back(cpu::Isa::kAvx2, "avx2");
    if (cpu::IsaAvailable(cpu::Isa::kAvx512)) isas.emplace_back(cpu::Isa::kAvx512, "avx512");
    if (cpu::IsaAvailable(cpu::Isa::kAvx512Vnni))
      isas.emplace_back(cpu::Isa::kAvx512Vnni, "avx512+vnni");
    if (cpu::IsaAvailable(cpu::Isa::kAvx512Bf16))
      isas.emplace_back(cpu::Isa::kAvx512Bf16, "avx512+vnni+bf16");
    return isas;
  }

  // The decode GEMVs a case runs: on CUDA with 16-bit weights, the CUDA-core one and the
  // tensor-core one (SetGpuTensorCoreGemv); one pass elsewhere. The mode is set on the way in
  // and the default restored after the last pass.
  std::vector<std::pair<bool, std::string>> GemvModes() const {
    if (device() != Device::kCuda || dtype() == DType::kF32) return {{false, ""}};
    return {{false, " (CUDA-core GEMV)"}, {true, " (tensor-core GEMV)"}};
  }
  struct GemvModeGuard {
    explicit GemvModeGuard(bool on) { SetGpuTensorCoreGemv(on); }
    ~GemvModeGuard() { SetGpuTensorCoreGemv(false); }
  };

  Device device() const { return GetParam().device; }
  DType dtype() const { return GetParam().dtype; }
  // The dtype the device computes activations in.
  DType act_dtype() const { return device() == Device::kCpu ? DType::kF32 : dtype(); }
  double tol() const { return RelTol(act_dtype()); }

  // Activations: f32 on the CPU; the parameter dtype on CUDA.
  Tensor Act(const std::vector<float>& v, const Shape& shape) const {
    Tensor t = Tensor::FromVector(v, shape);
    if (act_dtype() != DType::kF32) t = t.To(act_dtype());
    return device() == Device::kCpu ? t : t.ToDevice(device());
  }
  // Parameters stored in the parameter dtype; `stored` gets the values as stored.
  Tensor Weight(const std::vector<float>& v, const Shape& shape,
                std::vector<float>* stored = nullptr) const {
    Tensor t = Tensor::FromVector(v, shape).To(dtype());
    if (stored) {
      stored->resize(v.size());
      for (size_t i = 0; i < v.size(); ++i) (*stored)[i] = RoundTo(dtype(), v[i]);
    }
    return device() == Device::kCpu ? t : t.ToDevice(device());
  }
  // A quantized weight on the device, after checking that its stored layout dequantizes to
  // `ws` bit for bit; `ws` then becomes what the device multiplies by: on CUDA rounded to x's
  // dtype, as the dequantize-then-GEMM path of more than kQuantizedGemvTokens rows rounds it (the
  // decode GEMV multiplies the unrounded code - zero and scales each block's sum, within the
  // tolerance of that rounding).
  void QuantizedWeightOnDevice(const QuantizedWeight& q, std::vector<float>* ws, Tensor* w) const {
    const Tensor back = Dequantize(q);
    ASSERT_EQ(0, std::memcmp(back.raw(), ws->data(), ws->size() * sizeof(float)));
    if (device() != Device::kCpu) {
      for (float& v : *ws) v = RoundTo(dtype(), v);
    }
    *w = Tensor::Quantized(std::make_shared<const QuantizedWeight>(q)).ToDevice(device());
  }
  Tensor Index(const std::vector<int32_t>& v) const {
    Tensor t = Tensor::FromVector(v, {static_cast<int64_t>(v.size())});
    return device() == Device::kCpu ? t : t.ToDevice(device());
  }
  // Activation values back on the host in f32 (activations on CUDA are rounded on the way in,
  // so the inputs a reference should use are these, too).
  static std::vector<float> Host(const Tensor& t) {
    Tensor h = t.device() == Device::kCpu ? t : t.ToDevice(Device::kCpu);
    if (h.dtype() != DType::kF32) h = h.To(DType::kF32);
    return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
  }
};

// ---- Embedding ----------------------------------------------------------------------------

TEST_P(OpsTest, Embedding) {
  const int64_t vocab = 50, h = 33;
  std::vector<float> w_stored;
  Tensor w = Weight(Random(vocab * h, 1), {vocab, h}, &w_stored);
  const std::vector<int32_t> ids = {0, 49, 7, 7, 23};
  Tensor out;
  Embedding(Index(ids), w, &out);
  ASSERT_EQ(out.shape(), (Shape{5, h}));
  std::vector<double> ref;
  for (int32_t id : ids)
    for (int64_t j = 0; j < h; ++j) ref.push_back(w_stored[id * h + j]);
  ExpectClose(Host(out), ref, {}, 0, "embedding");

  if (device() == Device::kCpu) {  // i64 ids give the same rows
    Tensor ids64 = Tensor::FromVector(std::vector<int64_t>{49, 0}, {2});
    Tensor out64;
    Embedding(ids64, w, &out64);
    EXPECT_EQ(Host(out64)[0], w_stored[49 * h]);
    EXPECT_EQ(Host(out64)[h], w_stored[0]);
  }
}

// ---- Linear -------------------------------------------------------------------------------

// Linear's f64 reference, and each output's sum of |terms| (the scale of its rounding), with
// x as the CPU takes it for weights `w`: bf16 weights with AVX512_BF16 multiply x rounded to
// bf16, so the reference does then (and only then, so that the exact paths are held to x as it
// is).
struct LinearRef {
  std::vector<double> ref, scale;
};
LinearRef LinearReference(const Tensor& w, const std::vector<float>& xs,
                          const std::vector<float>& ws, const std::vector<float>* bs,
                          int64_t t_count, int64_t in, int64_t out_f) {
  std::vector<float> xr = xs;
  if (w.device() == Device::kCpu && cpu::Bf16DotTakes(w.dtype(), in)) {
    for (float& v : xr) v = Bf16ToF32(F32ToBf16(v));
  }
  LinearRef r{std::vector<double>(t_count * out_f), std::vector<double>(t_count * out_f)};
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t n = 0; n < out_f; ++n) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < in; ++k) {
        s += static_cast<double>(xr[t * in + k]) * ws[n * in + k];
        a += std::fabs(static_cast<double>(xr[t * in + k]) * ws[n * in + k]);
      }
      if (bs) {
        s += (*bs)[n];
        a += std::fabs((*bs)[n]);
      }
      r.ref[t * out_f + n] = s;
      r.scale[t * out_f + n] = a;
    }
  }
  return r;
}

// Linear into f32 logits (the lm_head's way, from activations of any dtype) against the
// double reference: f32 accumulation and no rounding of the result, so f32's tolerance
// whatever the inputs.
void ExpectF32Logits(const Tensor& x, const std::vector<float>& xs, const Tensor& w,
                     const std::vector<float>& ws, int64_t t_count, int64_t in, int64_t out_f,
                     const std::string& what) {
  Tensor out = Tensor::Empty({t_count, out_f}, DType::kF32, x.device());
  Linear(x, w, nullptr, &out);
  ASSERT_EQ(out.dtype(), DType::kF32);
  const LinearRef r = LinearReference(w, xs, ws, nullptr, t_count, in, out_f);
  ExpectClose(OpsTest::Host(out), r.ref, r.scale, RelTol(DType::kF32) * 10, what);
}

void LinearCase(const Tensor& x, const std::vector<float>& xs, const Tensor& w,
                const std::vector<float>& ws, const Tensor* bias, const std::vector<float>& bs,
                int64_t t_count, int64_t in, int64_t out_f, double tol, const std::string& what) {
  Tensor out;
  Linear(x, w, bias, &out);
  ASSERT_EQ(out.shape(), (Shape{t_count, out_f})) << what;
  const LinearRef r = LinearReference(w, xs, ws, bias ? &bs : nullptr, t_count, in, out_f);
  ExpectClose(OpsTest::Host(out), r.ref, r.scale, tol, what);
}

TEST_P(OpsTest, Linear) {
  struct Size {
    int64_t in, out;
  };
  // Odd sizes (tails of the 8-wide vectors and the 4-row tiles), an aligned one, one that
  // spans several 512-column chunks, and one of whole 16-byte vectors past the CUDA decode
  // GEMV's unrolled stride (32 lanes x 4 loads) with a tail. Short rows (a LoRA adapter's B,
  // f32 rows of at most 64 values: linear_short_rows.cc): whole and partial 8x8 blocks, more
  // rows than one chunk of 64.
  const Size sizes[] = {{67, 35}, {64, 16}, {1030, 45}, {1032, 21},
                        {8, 3},   {36, 70}, {48, 130},  {16, 9}};
  uint32_t seed = 10;
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const auto& [mma, mode] : GemvModes()) {
      const GemvModeGuard guard(mma);
      for (const Size& sz : sizes) {
        std::vector<float> ws, bs;
        Tensor w = Weight(Random(sz.out * sz.in, ++seed), {sz.out, sz.in}, &ws);
        Tensor b = Weight(Random(sz.out, ++seed), {sz.out}, &bs);
        for (int64_t t : {1, 2, 3, 17, 64}) {
          Tensor x = Act(Random(t * sz.in, ++seed), {t, sz.in});
          const std::vector<float> xs = Host(x);
          for (bool with_bias : {false, true}) {
            const std::string what =
                isa_name + mode + " T=" + std::to_string(t) + " in=" + std::to_string(sz.in) +
                " out=" + std::to_string(sz.out) + (with_bias ? " bias" : " no bias");
            LinearCase(x, xs, w, ws, with_bias ? &b : nullptr, bs, t, sz.in, sz.out, tol(), what);
          }
        }
      }
    }
  }
}

// A NaN in one token's activations comes out as NaN in that token's outputs only, on every
// code path and at decode and prefill sizes (the engine fails such a request by its NaN
// logits; bf16 weights' prefill rounds x to bf16, which must keep it a NaN).
TEST_P(OpsTest, LinearKeepsANaNInItsOwnRow) {
  if (device() != Device::kCpu) GTEST_SKIP() << "the CPU paths";
  const int64_t out_f = 40;
  for (const int64_t in : {96, 40}) {  // 40: short rows
    const Tensor w = Weight(Random(out_f * in, 21), {out_f, in});
    for (const auto& [isa, isa_name] : Isas()) {
      cpu::SetIsaForTesting(isa);
      for (int64_t t : {3, 40}) {
        std::vector<float> xs = Random(t * in, 22);
        xs[1 * in + 17] = std::numeric_limits<float>::quiet_NaN();
        Tensor out;
        Linear(Act(xs, {t, in}), w, nullptr, &out);
        const std::vector<float> got = Host(out);
        for (int64_t r = 0; r < t; ++r) {
          for (int64_t n = 0; n < out_f; ++n) {
            EXPECT_EQ(std::isnan(got[r * out_f + n]), r == 1)
                << isa_name << " in=" << in << " T=" << t << " row " << r << " output " << n;
          }
        }
      }
    }
  }
}

TEST_P(OpsTest, LinearThreeDimInputAndPreallocatedOut) {
  std::vector<float> ws;
  Tensor w = Weight(Random(24 * 40, 3), {24, 40}, &ws);
  Tensor x = Act(Random(2 * 3 * 40, 4), {2, 3, 40});
  Tensor out = Tensor::Zeros({2, 3, 24}, act_dtype(), device());
  const void* before = out.raw();
  Linear(x, w, nullptr, &out);
  EXPECT_EQ(out.raw(), before);
  ASSERT_EQ(out.shape(), (Shape{2, 3, 24}));
  const LinearRef r = LinearReference(w, Host(x), ws, nullptr, 6, 40, 24);
  ExpectClose(Host(out), r.ref, r.scale, tol(), "3-d linear");
}

// ---- Quantized Linear ----------------------------------------------------------------------

// A random quantized weight in the dense layout: codes, a group per column, scales, zeros.
struct DenseQuant {
  int bits;
  int64_t out, in, groups;
  std::vector<uint8_t> codes;
  std::vector<int32_t> group;
  std::vector<float> scales, zeros;

  // (code - zero) * scale in f32, as transformers computes the weight it multiplies by.
  std::vector<float> Weights() const {
    std::vector<float> w(out * in);
    for (int64_t n = 0; n < out; ++n) {
      for (int64_t k = 0; k < in; ++k) {
        const int64_t g = n * groups + group[k];
        w[n * in + k] = (static_cast<float>(codes[n * in + k]) - zeros[g]) * scales[g];
      }
    }
    return w;
  }
  QuantizedWeight Build() const {
    return BuildQuantized(bits, out, in, codes, group, groups, scales, zeros);
  }
};

// Groups: "channel" (one group), contiguous groups of `size`, or act-order (a seeded shuffle
// of contiguous groups, as GPTQ's g_idx with desc_act).
// `f16_scales`: scales that are f16 values, as GPTQ and AWQ write them (4-bit weights then keep
// compact run constants).
DenseQuant RandomQuant(int bits, int64_t out, int64_t in, int64_t group_size, bool act_order,
                       uint32_t seed, bool f16_scales = false) {
  DenseQuant q{bits, out, in, (in + group_size - 1) / group_size, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> code(0, (1 << bits) - 1);
  std::uniform_real_distribution<float> scale(0.001f, 0.02f);
  q.codes.resize(out * in);
  for (uint8_t& c : q.codes) c = static_cast<uint8_t>(code(rng));
  for (int64_t k = 0; k < in; ++k) q.group.push_back(static_cast<int32_t>(k / group_size));
  if (act_order) std::shuffle(q.group.begin(), q.group.end(), rng);
  for (int64_t i = 0; i < out * q.groups; ++i) {
    const float sc = scale(rng);
    q.scales.push_back(f16_scales ? F16ToF32(F32ToF16(sc)) : sc);
    q.zeros.push_back(static_cast<float>(code(rng) + (bits == 4 && i % 7 == 0 ? 1 : 0)));
  }
  return q;
}

TEST_P(OpsTest, QuantizedLinearEqualsLinearOnTheDequantizedWeight) {
  if (device() == Device::kCpu && dtype() != DType::kF32) GTEST_SKIP() << "same as Cpu_F32";
  struct Case {
    int bits;
    int64_t in, out, group_size;
    bool act_order;
  };
  // Per-channel, groups of 32 and 128, act-order shuffles, and odd sizes whose runs pad.
  const Case cases[] = {
      {8, 64, 16, 64, false},
      {4, 64, 16, 64, false},
      {4, 256, 35, 32, false},
      {8, 1030, 45, 128, true},
      {4, 1030, 45, 128, true},
      {4, 67, 21, 3, false},
      {4, 96, 9, 32, true},
      {4, 1536, 19, 128, true},
      {8, 1056, 11, 1056, false},
      // Runs of whole 128-column chunks, and a last chunk of 3 quarters: the tensor-core GEMV's.
      {4, 1120, 21, 128, false},
      {4, 544, 16, 544, false}};
  uint32_t seed = 40;
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const auto& [mma, mode] : GemvModes()) {
      const GemvModeGuard guard(mma);
      for (const Case& c : cases) {
        for (bool f16_scales : {false, true}) {
          const DenseQuant dq =
              RandomQuant(c.bits, c.out, c.in, c.group_size, c.act_order, ++seed, f16_scales);
          std::vector<float> ws = dq.Weights();
          const QuantizedWeight q = dq.Build();
          ASSERT_EQ(q.compact(), c.bits == 4 && f16_scales);  // 8-bit constants stay f32
          Tensor w;
          ASSERT_NO_FATAL_FAILURE(QuantizedWeightOnDevice(q, &ws, &w));
          std::vector<float> bs;
          const Tensor b = Weight(Random(c.out, ++seed), {c.out}, &bs);
          for (int64_t t : {1, 3, 12, 17, 64}) {
            const Tensor x = Act(Random(t * c.in, ++seed), {t, c.in});
            const std::string what =
                isa_name + mode + " bits=" + std::to_string(c.bits) + " T=" + std::to_string(t) +
                " in=" + std::to_string(c.in) + " group=" + std::to_string(c.group_size) +
                (c.act_order ? " act-order" : "") + (q.compact() ? " compact" : "");
            LinearCase(x, Host(x), w, ws, &b, bs, t, c.in, c.out, tol(), what);
          }
        }
      }
    }
  }
}

// What QuantizedToDevice notes for the CUDA tensor-core GEMV: how runs align in the stored
// columns (act-order groups of 128 are stored as runs of 128; groups of 3 pad to runs of 8),
// and whether the zeros are small non-negative integers.
TEST(QuantizedWeight, RunFactsForTheTensorCoreGemv) {
  struct Case {
    int64_t in, group;
    bool act_order;
    int64_t alignment;
  };
  for (const Case& c :
       {Case{1152, 128, false, 128}, Case{1152, 1152, false, 128}, Case{1152, 64, false, 64},
        Case{256, 32, false, 32}, Case{1030, 128, true, 128}, Case{67, 3, false, 8}}) {
    QuantizedWeight q = RandomQuant(4, 5, c.in, c.group, c.act_order, 7).Build();
    FindRunFacts(&q);
    EXPECT_EQ(q.run_alignment, c.alignment) << c.in << " group " << c.group;
    EXPECT_GE(q.max_zero, 0);
    EXPECT_LE(q.max_zero, 16);
    q.zeros.data<float>()[3] = 2.5f;
    FindRunFacts(&q);
    EXPECT_EQ(q.max_zero, -1) << "a zero with a fraction";
  }
}

// float8 e4m3fn by its definition: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits,
// subnormals at exponent 0, NaN at S.1111.111 and no infinities.
float Fp8ByDefinition(uint8_t v) {
  const int e = (v >> 3) & 15, m = v & 7;
  if ((v & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float mag = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1 + m / 8.0f, e - 7);
  return (v & 0x80) ? -mag : mag;
}

TEST(QuantizedWeight, Fp8E4M3DecodesEveryCodeByItsDefinition) {
  for (int v = 0; v < 256; ++v) {
    const float want = Fp8ByDefinition(static_cast<uint8_t>(v)), got = Fp8E4M3ToF32(v);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << v;
    } else {
      EXPECT_EQ(want, got) << v;  // exact, signed zero included
      EXPECT_EQ(std::signbit(want), std::signbit(got)) << v;
    }
  }
  EXPECT_EQ(448.f, Fp8E4M3ToF32(0x7E));
  EXPECT_EQ(std::ldexp(1.f, -9), Fp8E4M3ToF32(0x01));
}

TEST_P(OpsTest, Fp8LinearEqualsLinearOnTheDequantizedWeight) {
  if (device() == Device::kCpu && dtype() != DType::kF32) GTEST_SKIP() << "same as Cpu_F32";
  uint32_t seed = 90;
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const auto& [out, in] :
         std::vector<std::pair<int64_t, int64_t>>{{16, 64}, {45, 1030}, {9, 67}, {7, 1088}}) {
      std::mt19937 rng(++seed);
      std::vector<uint8_t> codes(out * in);
      for (uint8_t& c : codes) {
        do c = static_cast<uint8_t>(rng() & 0xFF);
        while ((c & 0x7F) == 0x7F);  // no NaN: the loader refuses them
      }
      // One scale per row, or per row and group of columns (fp8 blocks): groups of 32 lie
      // in whole 32-column blocks, groups of 44 do not (and are padded to 48 stored columns).
      for (const int64_t group : {in, int64_t{32}, int64_t{44}}) {
        const int64_t groups = (in + group - 1) / group;
        std::vector<float> scales, ws(out * in);
        for (int64_t i = 0; i < out * groups; ++i) {
          scales.push_back(0.0005f + 0.0001f * (rng() % 100));
        }
        std::vector<int32_t> group_of(in);
        for (int64_t k = 0; k < in; ++k) group_of[k] = static_cast<int32_t>(k / group);
        for (int64_t i = 0; i < out * in; ++i) {
          ws[i] = Fp8ByDefinition(codes[i]) * scales[(i / in) * groups + group_of[i % in]];
        }
        Tensor w;
        ASSERT_NO_FATAL_FAILURE(QuantizedWeightOnDevice(
            group == in ? BuildFp8Rows(out, in, codes, scales)
                        : BuildFp8(out, in, codes, group_of, groups, scales),
            &ws, &w));
        for (int64_t t : {1, 3, 12, 17, 64}) {
          const Tensor x = Act(Random(t * in, ++seed), {t, in});
          const std::string what = isa_name + " fp8 T=" + std::to_string(t) +
                                   " in=" + std::to_string(in) + " group=" + std::to_string(group);
          LinearCase(x, Host(x), w, ws, nullptr, {}, t, in, out, tol(), what);
        }
      }
    }
  }
}

// 4-bit codes that index a table (bitsandbytes' nf4 and fp4): w = table[code] * scale, on
// every ISA and device, against Linear on the weights so computed.
struct CodebookCase {
  QuantizedWeight q;
  std::vector<float> dense;
};
CodebookCase RandomCodebookWeight(int64_t out, int64_t in, int64_t group, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> table(16);
  for (int i = 0; i < 16; ++i) table[i] = (i - 7.5f) / 7.5f + 0.01f * (rng() % 7);
  table[7] = -0.f;  // a signed zero survives the lookup
  const int64_t groups = (in + group - 1) / group;
  std::vector<uint8_t> codes(out * in);
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & 15);
  std::vector<float> scales(out * groups);
  for (float& x : scales) x = 0.002f + 0.0001f * (rng() % 100);
  std::vector<int32_t> group_of(in);
  for (int64_t k = 0; k < in; ++k) group_of[k] = static_cast<int32_t>(k / group);
  CodebookCase c{BuildCodebook4(out, in, codes, group_of, groups, scales, table), {}};
  c.dense.resize(out * in);
  for (int64_t i = 0; i < out * in; ++i) {
    c.dense[i] = table[codes[i]] * scales[(i / in) * groups + group_of[i % in]];
  }
  return c;
}

TEST_P(OpsTest, CodebookLinearEqualsLinearOnTheDequantizedWeight) {
  if (device() == Device::kCpu && dtype() != DType::kF32) GTEST_SKIP() << "same as Cpu_F32";
  uint32_t seed = 190;
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const auto& [out, in] :
         std::vector<std::pair<int64_t, int64_t>>{{16, 64}, {45, 1030}, {9, 67}, {7, 1088}}) {
      // Blocks of 64 (bitsandbytes' default), 32, and 44 (padded to 48 stored columns).
      for (const int64_t group : {int64_t{64}, int64_t{32}, int64_t{44}}) {
        CodebookCase c = RandomCodebookWeight(out, in, group, ++seed);
        EXPECT_EQ(0, std::memcmp(Dequantize(c.q).raw(), c.dense.data(), c.dense.size() * 4))
            << "Dequantize " << out << "x" << in << " group " << group;
        Tensor w;
        ASSERT_NO_FATAL_FAILURE(QuantizedWeightOnDevice(c.q, &c.dense, &w));
        for (int64_t t : {1, 3, 12, 17, 64}) {
          const Tensor x = Act(Random(t * in, ++seed), {t, in});
          const std::string what = isa_name + " codebook T=" + std::to_string(t) +
                                   " in=" + std::to_string(in) + " group=" + std::to_string(group);
          LinearCase(x, Host(x), w, c.dense, nullptr, {}, t, in, out, tol(), what);
        }
      }
    }
  }
}

// Without act-order or padding the quantized path sums like the dense f32 one: the same bits
// as Linear on the dequantized weight (the decode path, T <= 16). The AVX-512 kernel applies
// 4-bit codes in its own column order (even columns of each 32, then odd), so there 8-bit only;
// the AVX2 kernels take each 32-column block's scale and zero out of its sum (linear_panels.cc)
// where runs are whole blocks, so there groups of 16 (which are not), the rest being checked
// within rounding by QuantizedLinearEqualsLinearOnTheDequantizedWeight.
TEST_P(OpsTest, QuantizedDecodeIsBitwiseTheDenseF32Path) {
  if (device() != Device::kCpu || dtype() != DType::kF32) GTEST_SKIP() << "CPU property";
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (int bits : {8, 4, 5}) {  // 5: 4-bit codes with compact run constants
      const bool compact = bits == 5;
      if (compact) bits = 4;
      const bool vnni = isa == cpu::Isa::kAvx512Vnni || isa == cpu::Isa::kAvx512Bf16;
      if (vnni || (bits == 4 && isa == cpu::Isa::kAvx512)) continue;
      const int64_t group = isa == cpu::Isa::kAvx2 ? 16 : 128;
      const DenseQuant dq = RandomQuant(bits, 37, 1024, group, false, 7, compact);
      const Tensor w = Tensor::Quantized(std::make_shared<const QuantizedWeight>(dq.Build()));
      const Tensor dense = Tensor::FromVector(dq.Weights(), {37, 1024});
      const Tensor x = Act(Random(5 * 1024, 8), {5, 1024});
      Tensor got, want;
      Linear(x, w, nullptr, &got);
      Linear(x, dense, nullptr, &want);
      ASSERT_EQ(0, std::memcmp(got.raw(), want.raw(), want.nbytes())) << isa_name << " " << bits;
    }
    // Codes that index a table sum as the dense path does on columns taken in the kernel's
    // order, at every decode T: the scalar kernel in order; the AVX2 one each 8 as
    // 0 2 4 6 1 3 5 7 (linear_lut.cc); the AVX-512 one each 32 as its even columns, then its
    // odd ones (linear_avx512.cc, whose f32 kernel sums two such halves the same way).
    {
      const int64_t out_f = 37, in = 1024;
      const CodebookCase c = RandomCodebookWeight(out_f, in, 64, 12);
      const int64_t span = isa == cpu::Isa::kScalar ? 1 : isa == cpu::Isa::kAvx2 ? 8 : 32;
      auto reorder = [span](const std::vector<float>& v) {
        std::vector<float> o(v.size());
        for (size_t i = 0; i < v.size(); i += span) {
          for (int64_t j = 0; j < span; ++j) {  // evens of the span, then odds
            o[i + j] = v[i + (j < span / 2 ? 2 * j : 2 * (j - span / 2) + 1) % span];
          }
        }
        return o;
      };
      for (int64_t t : {1, 2, 5, 16}) {
        const std::vector<float> xs = Random(t * in, 8);
        Tensor got, want;
        Linear(Act(xs, {t, in}), Tensor::Quantized(std::make_shared<const QuantizedWeight>(c.q)),
               nullptr, &got);
        Linear(Act(reorder(xs), {t, in}), Tensor::FromVector(reorder(c.dense), {out_f, in}),
               nullptr, &want);
        ASSERT_EQ(0, std::memcmp(got.raw(), want.raw(), want.nbytes()))
            << isa_name << " codebook T=" << t;
      }
    }
  }
}

// Exact decode from the code panels two at a time in 16-lane vectors (AVX-512: Zen 4's path for
// 4-bit codes) gives the 8-lane kernel's bits: every lane takes the same operations in the same
// order. Both widths, 8- and 4-bit codes, f32 and compact run constants, every decode T's mix
// of 4-, 2- and 1-token tiles, an odd last panel (37 rows: 5 panels) and a bias.
TEST_P(OpsTest, ExactPanelsOnAvx512GiveTheAvx2Bits) {
  if (device() != Device::kCpu || dtype() != DType::kF32) GTEST_SKIP() << "CPU property";
  if (!cpu::IsaAvailable(cpu::Isa::kAvx512)) GTEST_SKIP() << "skipped: this CPU has no AVX-512";
  const int64_t out_f = 37, in = 1024;
  const std::vector<float> bias = Random(out_f, 3);
  for (int bits : {8, 4, 5}) {  // 5: 4-bit codes with compact run constants
    const bool compact = bits == 5;
    const QuantizedWeight q =
        RandomQuant(compact ? 4 : bits, out_f, in, 128, false, 11, compact).Build();
    const cpu::CodePanels* panels = cpu::CodePanelsOf(q);
    ASSERT_NE(panels, nullptr);
    for (int64_t t : {1, 2, 3, 4, 7, 16}) {
      const std::vector<float> x = Random(t * in, 12);
      std::vector<float> narrow(t * out_f), wide(t * out_f);
      cpu::SmallArgs a{x.data(), t, in, q.codes.raw(), &q, out_f, bias.data(), narrow.data()};
      cpu::PanelsExactLinear(a, *panels, /*avx512=*/false);
      a.out = wide.data();
      cpu::PanelsExactLinear(a, *panels, /*avx512=*/true);
      ASSERT_EQ(0, std::memcmp(narrow.data(), wide.data(), narrow.size() * 4))
          << "bits " << bits << " T=" << t;
    }
  }
}

// The decode path gives every row the same bits whatever else is in the batch (T <= 16), so
// that a request's output does not depend on its batch mates: on every code path, for float
// and quantized weights (8-bit, 4-bit, fp8) alike.
void ExpectBatchInvariant(const Tensor& x, const Tensor& w, int64_t out_f,
                          const std::string& what) {
  Tensor all;
  Linear(x, w, nullptr, &all);
  for (int64_t t : {0, 5, 15}) {
    Tensor one;
    Linear(x.Rows(t, t + 1), w, nullptr, &one);
    for (int64_t n = 0; n < out_f; ++n) {
      ASSERT_EQ(one.data<float>()[n], all.data<float>()[t * out_f + n])
          << what << " " << t << " " << n;
    }
  }
  for (int64_t rows : {2, 3}) {
    Tensor some;
    Linear(x.Rows(4, 4 + rows), w, nullptr, &some);
    for (int64_t i = 0; i < rows * out_f; ++i)
      ASSERT_EQ(some.data<float>()[i], all.data<float>()[4 * out_f + i]) << what << " " << rows;
  }
}

// On CUDA, decode-sized calls (up to 8 rows) run a dense GEMV (on CUDA cores, or on tensor
// cores for 16-bit weights when SetGpuTensorCoreGemv asks): each row's outputs are the same bits
// alone as beside the others, as the CPU's decode kernels are.
TEST_P(OpsTest, LinearDecodeRowsAreBatchInvariantOnCuda) {
  if (device() != Device::kCuda) GTEST_SKIP() << "the CUDA decode GEMV";
  const int64_t in = 1032, out_f = 45, rows = 8;
  std::vector<float> ws;
  const Tensor w = Weight(Random(out_f * in, 91), {out_f, in}, &ws);
  const Tensor x = Act(Random(rows * in, 92), {rows, in});
  // 4-bit GPTQ-shaped codes in groups of 128 (up to 16 rows: kQuantizedGemvTokens).
  const int64_t q_in = 1152, q_rows = 16;
  const DenseQuant dq = RandomQuant(4, out_f, q_in, 128, false, 93, true);
  std::vector<float> qs = dq.Weights();
  Tensor qw;
  ASSERT_NO_FATAL_FAILURE(QuantizedWeightOnDevice(dq.Build(), &qs, &qw));
  const Tensor& cqw = qw;
  const Tensor qx = Act(Random(q_rows * q_in, 94), {q_rows, q_in});
  for (const auto& [mma, mode] : GemvModes()) {
    const GemvModeGuard guard(mma);
    for (const auto& [weight, input, n_rows, what] :
         {std::tuple{&w, &x, rows, "16-bit"}, std::tuple{&cqw, &qx, q_rows, "4-bit"}}) {
      Tensor all;
      Linear(*input, *weight, nullptr, &all);
      const std::vector<float> want = Host(all);
      for (int64_t n : {1, 3, 9}) {
        for (int64_t r = 0; r + n <= n_rows; r += n) {
          Tensor some;
          Linear(input->Rows(r, r + n), *weight, nullptr, &some);
          const std::vector<float> got = Host(some);
          for (int64_t i = 0; i < n * out_f; ++i) {
            ASSERT_EQ(got[i], want[r * out_f + i])
                << what << mode << " rows " << r << ".." << r + n << " at " << i;
          }
        }
      }
    }
  }
}

TEST_P(OpsTest, LinearSmallBatchIsBatchInvariant) {
  if (device() != Device::kCpu || dtype() == DType::kF16) GTEST_SKIP() << "CPU property";
  const int64_t out_f = 37, t_count = 16;
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (int64_t in : {36, 64}) {  // short rows (linear_short_rows.cc): 2 and 8 tokens a pass
      const Tensor x = Act(Random(t_count * in, 6), {t_count, in});
      ExpectBatchInvariant(x, Weight(Random(out_f * in, 5), {out_f, in}), out_f,
                           isa_name + " short rows " + std::to_string(in));
    }
    for (int64_t in : {1030, 1024}) {  // a partial last block, and none
      const Tensor x = Act(Random(t_count * in, 6), {t_count, in});
      ExpectBatchInvariant(x, Weight(Random(out_f * in, 5), {out_f, in}), out_f,
                           isa_name + " dense " + std::to_string(in));
      if (dtype() != DType::kF32) continue;
      for (int bits : {8, 4}) {
        for (bool f16_scales : {false, true}) {
          const QuantizedWeight q = RandomQuant(bits, out_f, in, 128, false, 7, f16_scales).Build();
          ExpectBatchInvariant(
              x, Tensor::Quantized(std::make_shared<const QuantizedWeight>(q)), out_f,
              isa_name + " bits=" + std::to_string(bits) + (q.compact() ? " compact" : ""));
        }
      }
      std::vector<uint8_t> codes(out_f * in);
      for (size_t i = 0; i < codes.size(); ++i)
        codes[i] = static_cast<uint8_t>(i * 37 % 251) & 0xFE;
      const QuantizedWeight f8 = BuildFp8Rows(out_f, in, codes, std::vector<float>(out_f, 0.01f));
      ExpectBatchInvariant(x, Tensor::Quantized(std::make_shared<const QuantizedWeight>(f8)), out_f,
                           isa_name + " fp8");
      const CodebookCase lut = RandomCodebookWeight(out_f, in, 64, 11);
      ExpectBatchInvariant(x, Tensor::Quantized(std::make_shared<const QuantizedWeight>(lut.q)),
                           out_f, isa_name + " codebook");
    }
  }
}

// The AVX-512 prefill GEMMs (T > 16; f32, and bf16 weights' own with AVX512_BF16) sum each
// output in one order whatever the batch: a prompt's rows come out the same alone or beside
// others, at any offset in the register tiles.
TEST_P(OpsTest, LinearPrefillOnAvx512IsBatchInvariant) {
  if (device() != Device::kCpu || dtype() == DType::kF16) GTEST_SKIP() << "CPU property";
  if (!cpu::IsaAvailable(cpu::Isa::kAvx512)) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::vector<cpu::Isa> isas = {cpu::Isa::kAvx512};
  if (cpu::IsaAvailable(cpu::Isa::kAvx512Bf16)) isas.push_back(cpu::Isa::kAvx512Bf16);
  const int64_t out_f = 45, t_count = 64;
  for (const cpu::Isa isa : isas) {
    cpu::SetIsaForTesting(isa);
    for (int64_t in : {1030, 512}) {  // a partial last column block, and none
      const Tensor x = Act(Random(t_count * in, 8), {t_count, in});
      const QuantizedWeight q = RandomQuant(4, out_f, in, 128, false, 9, true).Build();
      const std::pair<Tensor, std::string> weights[] = {
          {Weight(Random(out_f * in, 5), {out_f, in}), "dense"},
          {Tensor::Quantized(std::make_shared<const QuantizedWeight>(q)), "4-bit"}};
      for (const auto& [w, name] : weights) {
        Tensor all;
        Linear(x, w, nullptr, &all);
        for (const auto& [t0, rows] : {std::pair<int64_t, int64_t>{0, 17}, {7, 29}, {30, 34}}) {
          Tensor some;
          Linear(x.Rows(t0, t0 + rows), w, nullptr, &some);
          for (int64_t i = 0; i < rows * out_f; ++i)
            ASSERT_EQ(some.data<float>()[i], all.data<float>()[t0 * out_f + i])
                << name << " isa=" << static_cast<int>(isa) << " in=" << in << " rows " << t0 << "+"
                << rows << " at " << i;
        }
      }
    }
  }
}

// Activations the way LLMs have them: an outlier far above the rest, values spread over many
// orders of magnitude, an all-zero row, and a row with a NaN (which must come out NaN, not be
// hidden). The VNNI path holds x as fixed point per token, and the AVX2 4-bit panels scale x's
// columns by powers of two down to 2^-24: they must keep f32's accuracy here.
TEST_P(OpsTest, QuantizedLinearOnWideRangeActivations) {
  if (device() != Device::kCpu || dtype() != DType::kF32) GTEST_SKIP() << "CPU paths";
  const int64_t in = 1024, out_f = 21, t_count = 4;
  std::vector<float> xs = Random(t_count * in, 31);
  xs[17] = 3e4f;  // row 0: one outlier
  std::mt19937 rng(5);
  for (int64_t k = 0; k < in; ++k)  // row 1: magnitudes from 1e-6 to 1e3
    xs[in + k] *= std::pow(10.f, -6.f + 9.f * static_cast<float>(rng() % 1000) / 1000.f);
  std::fill(xs.begin() + 2 * in, xs.begin() + 3 * in, 0.f);  // row 2: zeros
  std::vector<float> finite = xs;
  xs[3 * in + 100] = std::numeric_limits<float>::quiet_NaN();  // row 3
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const auto& [bits, group] : {std::pair<int, int64_t>{8, in}, {8, 128}, {4, 32}}) {
      const DenseQuant dq = RandomQuant(bits, out_f, in, group, false, 3);
      const Tensor w = Tensor::Quantized(std::make_shared<const QuantizedWeight>(dq.Build()));
      const std::string what =
          isa_name + " bits=" + std::to_string(bits) + " group=" + std::to_string(group);
      // Rows 0-2 against the f64 reference. The AVX2 kernels sum code * x and take zero *
      // sum(x) out of each block, so their rounding is relative to those terms, |x| * (code +
      // zero) * scale, rather than to |x * w| (the outlier's code may be near its zero).
      const std::vector<float> ws = dq.Weights();
      std::vector<double> ref(3 * out_f), terms(3 * out_f);
      for (int64_t t = 0; t < 3; ++t) {
        for (int64_t n = 0; n < out_f; ++n) {
          for (int64_t k = 0; k < in; ++k) {
            const int64_t g = n * dq.groups + dq.group[k];
            const double x = finite[t * in + k];
            ref[t * out_f + n] += x * ws[n * in + k];
            terms[t * out_f + n] +=
                std::fabs(x) * (dq.codes[n * in + k] + dq.zeros[g]) * dq.scales[g];
          }
        }
      }
      Tensor out;
      Linear(Act(std::vector<float>(finite.begin(), finite.begin() + 3 * in), {3, in}), w, nullptr,
             &out);
      ExpectClose(Host(out), ref, terms, tol(), what);
      // Then all four, where only row 3 may be NaN.
      out = Tensor();
      Linear(Act(xs, {t_count, in}), w, nullptr, &out);
      for (int64_t i = 0; i < t_count * out_f; ++i) {
        EXPECT_EQ(std::isnan(out.data<float>()[i]), i >= 3 * out_f) << what << " " << i;
      }
    }
  }
}

TEST(QuantizedWeight, Int8RowsRoundToTheNearestStepOfTheRowAbsmax) {
  const std::vector<float> v = Random(6 * 50, 3, -2, 2);
  const QuantizedWeight q = QuantizeInt8Rows(Tensor::FromVector(v, {6, 50}));
  const Tensor back = Dequantize(q);
  for (int64_t n = 0; n < 6; ++n) {
    float absmax = 0;
    for (int64_t k = 0; k < 50; ++k) absmax = std::max(absmax, std::fabs(v[n * 50 + k]));
    for (int64_t k = 0; k < 50; ++k) {
      EXPECT_LE(std::fabs(back.data<float>()[n * 50 + k] - v[n * 50 + k]),
                absmax / 127 / 2 * (1 + 1e-5))
          << n << " " << k;
    }
  }
}

// The codes are std::nearbyint(w / scale) exactly, ties to even, in every row of a weight
// large enough to be split over the threads.
TEST(QuantizedWeight, Int8RowsRoundHalfToEvenLikeNearbyint) {
  const std::vector<float> row = {127.f, 2.5f, 3.5f, -2.5f, -0.5f, 0.5f, 126.5f, -127.f, 0.f};
  const int64_t out = 100, in = static_cast<int64_t>(row.size()) + 1;
  std::vector<float> v;
  for (int64_t n = 0; n < out; ++n) {
    v.insert(v.end(), row.begin(), row.end());
    v.push_back(0.37f * static_cast<float>(n) - 18.f);
  }
  const QuantizedWeight q = QuantizeInt8Rows(Tensor::FromVector(v, {out, in}));
  for (int64_t n = 0; n < out; ++n) {
    EXPECT_EQ(q.scales.data<float>()[n], 1.f);  // absmax 127
    for (int64_t k = 0; k < in; ++k) {
      const int code = q.codes.data<uint8_t>()[n * q.codes.dim(1) + k] - 128;
      EXPECT_EQ(code, static_cast<int>(std::nearbyint(v[n * in + k]))) << n << " " << k;
    }
  }
}

// Rows of 100 (three 32-column vectors and a ragged tail) through the AVX2 and the scalar
// paths: the same scales and codes, and the codes nearbyint(w / scale) gives; an all-zero row
// is all zero codes; the first row holding a NaN or an infinity is reported.
TEST(QuantizedWeight, Int8RowsAreTheSameOnEveryIsa) {
  const int64_t out = 40, in = 100;
  std::vector<float> v(out * in);
  uint32_t state = 7;
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    x = (static_cast<float>(state >> 8) / 16777216.f - 0.5f) * 3.f;
  }
  v[3 * in + 99] = std::numeric_limits<float>::quiet_NaN();
  v[5 * in + 40] = std::numeric_limits<float>::infinity();
  v[7 * in + 31] = 6.f;  // the row's absmax in the last lane of a vector: code 127
  std::fill(v.begin() + 9 * in, v.begin() + 10 * in, 0.f);
  std::vector<QuantizedWeight> got;
  for (cpu::Isa isa : {cpu::Isa::kScalar, cpu::Isa::kAuto}) {
    cpu::SetIsaForTesting(isa);
    int64_t nonfinite = -1;
    got.push_back(QuantizeInt8Rows(Tensor::FromVector(v, {out, in}), nullptr, &nonfinite));
    EXPECT_EQ(nonfinite, 3);
  }
  cpu::SetIsaForTesting(cpu::Isa::kAuto);
  for (int64_t k = 0; k < in; ++k)
    EXPECT_EQ(got[1].codes.data<uint8_t>()[9 * got[1].codes.dim(1) + k], 128);
  ASSERT_EQ(got[0].codes.nbytes(), got[1].codes.nbytes());
  EXPECT_EQ(0, std::memcmp(got[0].codes.raw(), got[1].codes.raw(), got[0].codes.nbytes()));
  EXPECT_EQ(0, std::memcmp(got[0].scales.raw(), got[1].scales.raw(), got[0].scales.nbytes()));
  for (int64_t n = 0; n < out; ++n) {
    if (n == 3 || n == 5 || n == 9) continue;  // not finite; all zero (checked above)
    const float scale = got[1].scales.data<float>()[n];
    for (int64_t k = 0; k < in; ++k) {
      const int code = got[1].codes.data<uint8_t>()[n * got[1].codes.dim(1) + k] - 128;
      EXPECT_EQ(code, static_cast<int>(std::nearbyint(v[n * in + k] / scale))) << n << " " << k;
    }
  }
  EXPECT_EQ(got[1].codes.data<uint8_t>()[7 * got[1].codes.dim(1) + 31], 255);
}

TEST(QuantizedWeight, ConcatenatedRowsDequantizeToTheStackedWeights) {
  const DenseQuant a = RandomQuant(4, 5, 96, 32, true, 1);
  DenseQuant b = RandomQuant(4, 3, 96, 32, true, 2);
  b.group = a.group;  // parts of one fused projection share g_idx
  const QuantizedWeight qa = a.Build(), qb = b.Build();
  ASSERT_TRUE(QuantizedCompatible(qa, qb));
  const Tensor both = Dequantize(ConcatQuantizedRows({&qa, &qb}));
  std::vector<float> want = a.Weights();
  const std::vector<float> wb = b.Weights();
  want.insert(want.end(), wb.begin(), wb.end());
  ASSERT_EQ(both.numel(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(0, std::memcmp(both.raw(), want.data(), want.size() * sizeof(float)));
  const QuantizedWeight other = RandomQuant(4, 3, 96, 32, true, 3).Build();
  EXPECT_FALSE(QuantizedCompatible(qa, other));  // another column order
}

// 4-bit run constants that are f16 scales and integer zeros are kept compact (3 bytes a run),
// holding the same values: Dequantize, the f32 form (ExpandRunConstants, which CUDA gets) and
// concatenation with parts of either form all give the weights those constants define.
TEST(QuantizedWeight, CompactRunConstantsHoldTheSameValues) {
  const DenseQuant a = RandomQuant(4, 5, 96, 32, true, 1, /*f16_scales=*/true);
  DenseQuant b = RandomQuant(4, 3, 96, 32, true, 2, /*f16_scales=*/false);
  DenseQuant c = RandomQuant(4, 4, 96, 32, true, 4, /*f16_scales=*/true);
  b.group = c.group = a.group;
  const QuantizedWeight qa = a.Build(), qb = b.Build(), qc = c.Build();
  ASSERT_TRUE(qa.compact());
  ASSERT_FALSE(qb.compact());
  EXPECT_EQ(qa.scales.nbytes() + qa.zeros.nbytes(), static_cast<size_t>(5 * qa.runs() * 3));
  auto same_bits = [](const Tensor& t, const std::vector<float>& want) {
    return t.numel() == static_cast<int64_t>(want.size()) &&
           std::memcmp(t.raw(), want.data(), want.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(Dequantize(qa), a.Weights()));
  const QuantizedWeight wide = ExpandRunConstants(qa);
  EXPECT_FALSE(wide.compact());
  EXPECT_TRUE(same_bits(Dequantize(wide), a.Weights()));
  for (const auto& [second, dq] :
       std::vector<std::pair<const QuantizedWeight*, const DenseQuant*>>{{&qb, &b}, {&qc, &c}}) {
    const QuantizedWeight both = ConcatQuantizedRows({&qa, second});
    EXPECT_EQ(both.compact(), second->compact());  // mixed forms are stacked in f32
    std::vector<float> want = a.Weights();
    const std::vector<float> rest = dq->Weights();
    want.insert(want.end(), rest.begin(), rest.end());
    EXPECT_TRUE(same_bits(Dequantize(both), want));
  }
  // A zero outside [0, 255] or a scale that is not an f16 value keeps the f32 form.
  DenseQuant d = RandomQuant(4, 2, 64, 32, false, 5, /*f16_scales=*/true);
  d.zeros[1] = 256;
  EXPECT_FALSE(d.Build().compact());
  d = RandomQuant(4, 2, 64, 32, false, 5, /*f16_scales=*/true);
  d.zeros[1] = 2.5f;
  EXPECT_FALSE(d.Build().compact());
  d = RandomQuant(4, 2, 64, 32, false, 5, /*f16_scales=*/true);
  d.scales[0] = 0.01f;  // not an f16 value
  EXPECT_FALSE(d.Build().compact());
}

// ---- Norms and elementwise ----------------------------------------------------------------

TEST_P(OpsTest, RmsNorm) {
  const int64_t t_count = 5, h = 67;
  const float eps = 1e-6f;
  std::vector<float> ws;
  Tensor w = Weight(Random(h, 7, 0.5f, 1.5f), {h}, &ws);
  std::vector<float> xv = Random(t_count * h, 8, -3, 3);
  for (int64_t i = 0; i < h; ++i) xv[4 * h + i] *= 1e-3f;  // a small-norm row
  Tensor x = Act(xv, {t_count, h});
  const std::vector<float> xs = Host(x);
  std::vector<double> ref;
  for (int64_t t = 0; t < t_count; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += double{xs[t * h + i]} * xs[t * h + i];
    const double inv = 1 / std::sqrt(ss / h + eps);
    for (int64_t i = 0; i < h; ++i) ref.push_back(xs[t * h + i] * inv * ws[i]);
  }
  Tensor out;
  RmsNorm(x, w, eps, &out);
  ExpectClose(Host(out), ref, {}, tol(), "rmsnorm");
  RmsNorm(x, w, eps, &x);  // in place
  ExpectClose(Host(x), ref, {}, tol(), "rmsnorm in place");
}

TEST_P(OpsTest, LayerNorm) {
  const int64_t t_count = 4, h = 45;
  const float eps = 1e-5f;
  std::vector<float> ws, bs;
  Tensor w = Weight(Random(h, 9, 0.5f, 1.5f), {h}, &ws);
  Tensor b = Weight(Random(h, 10), {h}, &bs);
  std::vector<float> xv = Random(t_count * h, 11, -2, 2);
  for (int64_t i = 0; i < h; ++i) xv[2 * h + i] += 100.0f;  // a large mean
  Tensor x = Act(xv, {t_count, h});
  const std::vector<float> xs = Host(x);
  for (bool with_bias : {false, true}) {
    std::vector<double> ref, scale;
    for (int64_t t = 0; t < t_count; ++t) {
      double mean = 0, var = 0;
      for (int64_t i = 0; i < h; ++i) mean += xs[t * h + i];
      mean /= h;
      for (int64_t i = 0; i < h; ++i) var += (xs[t * h + i] - mean) * (xs[t * h + i] - mean);
      var /= h;
      for (int64_t i = 0; i < h; ++i) {
        const double rstd = 1 / std::sqrt(var + eps);
        const double normed = (xs[t * h + i] - mean) * rstd * ws[i];
        ref.push_back(normed + (with_bias ? bs[i] : 0.0));
        // An f32 implementation rounds x and the mean before subtracting: scale by their size.
        scale.push_back((std::fabs(xs[t * h + i]) + std::fabs(mean)) * rstd * std::fabs(ws[i]));
      }
    }
    Tensor out;
    LayerNorm(x, w, with_bias ? &b : nullptr, eps, &out);
    ExpectClose(Host(out), ref, scale, tol(), with_bias ? "layernorm bias" : "layernorm");
  }
}

TEST_P(OpsTest, AddInPlace) {
  const std::vector<float> a = Random(3 * 29, 12), b = Random(3 * 29, 13);
  Tensor x = Act(a, {3, 29});
  Tensor y = Act(b, {3, 29});
  const std::vector<float> as = Host(x), bs = Host(y);
  AddInPlace(&x, y);
  std::vector<double> ref, scale;
  for (size_t i = 0; i < a.size(); ++i) {
    ref.push_back(double{as[i]} + bs[i]);
    scale.push_back(std::fabs(as[i]) + std::fabs(bs[i]));
  }
  ExpectClose(Host(x), ref, scale, tol(), "add");
}

TEST_P(OpsTest, AddRmsNormIsAddThenNorm) {
  const int64_t t_count = 3, h = 40;
  const float eps = 1e-5f;
  Tensor w = Weight(Random(h, 50, 0.5f, 1.5f), {h});
  Tensor x = Act(Random(t_count * h, 51, -2, 2), {t_count, h});
  Tensor y = Act(Random(t_count * h, 52, -2, 2), {t_count, h});
  // The unfused ops on the same device and dtype are the reference: same roundings.
  Tensor x_ref = Act(Host(x), {t_count, h});
  AddInPlace(&x_ref, y);
  Tensor ref_out;
  RmsNorm(x_ref, w, eps, &ref_out);
  Tensor out;
  AddRmsNorm(&x, y, w, eps, &out);
  const std::vector<float> got_x = Host(x), want_x = Host(x_ref);
  const std::vector<float> got = Host(out), want = Host(ref_out);
  ExpectClose(got_x, std::vector<double>(want_x.begin(), want_x.end()), {}, 0, "residual sum");
  ExpectClose(got, std::vector<double>(want.begin(), want.end()), {}, tol(), "fused norm");
}

TEST_P(OpsTest, EmbeddingSliceZeroesOtherRanksRows) {
  const int64_t rows = 10, h = 9, first = 20;  // this rank holds ids [20, 30)
  std::vector<float> w_stored;
  Tensor w = Weight(Random(rows * h, 53), {rows, h}, &w_stored);
  const std::vector<int32_t> ids = {25, 3, 20, 29, 30, 99};
  Tensor out;
  EmbeddingSlice(Index(ids), w, first, &out);
  ASSERT_EQ(out.shape(), (Shape{6, h}));
  std::vector<double> ref;
  for (int32_t id : ids) {
    for (int64_t j = 0; j < h; ++j) {
      const bool mine = first <= id && id < first + rows;
      ref.push_back(mine ? w_stored[(id - first) * h + j] : 0.0);
    }
  }
  ExpectClose(Host(out), ref, {}, 0, "embedding slice");
}

TEST_P(OpsTest, CopyColumnsMovesABlockOfColumns) {
  const int64_t rows = 4, src_cols = 11, dst_cols = 7;
  Tensor src = Act(Random(rows * src_cols, 54), {rows, src_cols});
  Tensor dst = Act(std::vector<float>(rows * dst_cols, 0.0f), {rows, dst_cols});
  CopyColumns(src, 3, 5, &dst, 1);
  const std::vector<float> s = Host(src), d = Host(dst);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dst_cols; ++c) {
      const float want = (c >= 1 && c < 6) ? s[r * src_cols + 3 + (c - 1)] : 0.0f;
      ASSERT_EQ(d[r * dst_cols + c], want) << r << " " << c;
    }
  }
}

TEST_P(OpsTest, LinearIntoF32Logits) {
  // The lm_head writes f32 logits from activations of any dtype.
  const int64_t t_count = 3, in = 24, out_f = 19;
  std::vector<float> ws;
  Tensor w = Weight(Random(out_f * in, 55), {out_f, in}, &ws);
  Tensor x = Act(Random(t_count * in, 56), {t_count, in});
  const std::vector<float> xs = Host(x);
  ExpectF32Logits(x, xs, w, ws, t_count, in, out_f, "f32 logits");
}

// cuBLASLt may offer no algorithm for a shape or an alignment: Linear then runs its own tiled
// GEMM instead of aborting the shard, with the same results within the dtype's tolerance
// (odd sizes across the 16 x 16 tiles, a bias, and f32 logits from any dtype).
TEST_P(OpsTest, LinearWithoutACublasLtAlgorithm) {
  if (device() != Device::kCuda) GTEST_SKIP() << "the CUDA Linear's fallback";
#ifdef TGIS_WITH_CUDA
  struct Fallback {
    Fallback() { cuda::ForceGemmFallbackForTesting(true); }
    ~Fallback() { cuda::ForceGemmFallbackForTesting(false); }
  } fallback;
  uint32_t seed = 70;
  for (const auto& [in, out_f] : std::vector<std::pair<int64_t, int64_t>>{{67, 35}, {1030, 45}}) {
    std::vector<float> ws, bs;
    Tensor w = Weight(Random(out_f * in, ++seed), {out_f, in}, &ws);
    Tensor b = Weight(Random(out_f, ++seed), {out_f}, &bs);
    for (int64_t t : {1, 17}) {
      Tensor x = Act(Random(t * in, ++seed), {t, in});
      const std::vector<float> xs = Host(x);
      for (bool with_bias : {false, true}) {
        const std::string what = "fallback T=" + std::to_string(t) + " in=" + std::to_string(in) +
                                 (with_bias ? " bias" : "");
        LinearCase(x, xs, w, ws, with_bias ? &b : nullptr, bs, t, in, out_f, tol(), what);
      }
      ExpectF32Logits(x, xs, w, ws, t, in, out_f, "fallback f32 logits");
    }
  }
#endif
}

TEST_P(OpsTest, GatedActivation) {
  const int64_t t_count = 3, inter = 37;
  std::vector<float> v = Random(t_count * 2 * inter, 14, -8, 8);
  v[0] = -90.0f;  // exp overflow territory
  v[1] = 90.0f;
  Tensor gu = Act(v, {t_count, 2 * inter});
  const std::vector<float> s = Host(gu);
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (Activation kind :
         {Activation::kSilu, Activation::kGeluTanh, Activation::kGeluErf, Activation::kRelu}) {
      std::vector<double> ref;
      for (int64_t t = 0; t < t_count; ++t) {
        for (int64_t i = 0; i < inter; ++i) {
          const double g = s[t * 2 * inter + i], u = s[t * 2 * inter + inter + i];
          double a = 0;
          switch (kind) {
            case Activation::kSilu:
              a = g / (1 + std::exp(-g));
              break;
            case Activation::kGeluTanh:
              a = 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
              break;
            case Activation::kGeluErf:
              a = 0.5 * g * (1 + std::erf(g / std::sqrt(2.0)));
              break;
            case Activation::kRelu:
              a = g > 0 ? g : 0;
              break;
          }
          ref.push_back(a * u);
        }
      }
      Tensor out;
      GatedActivation(kind, gu, &out);
      ASSERT_EQ(out.shape(), (Shape{t_count, inter}));
      // Absolute slack of 1e-6 * tol: silu(-90) ~ -7e-38 is 0 in f32 arithmetic (exp overflows);
      // gelu of a large negative value is the difference of two O(|x|) quantities.
      std::vector<double> scale;
      for (int64_t t = 0; t < t_count; ++t) {
        for (int64_t i = 0; i < inter; ++i) {
          const double g = s[t * 2 * inter + i], u = s[t * 2 * inter + inter + i];
          scale.push_back(1e-6 + std::fabs(u) * std::min(1.0, std::fabs(g)));
        }
      }
      ExpectClose(Host(out), ref, scale, tol(), "gated activation (" + isa_name + ")");
    }
  }
}

// GPT-OSS's SwiGLU with its clamps (limit 7, alpha 1.702) on values from -12 to 12, so that
// both clamps bite, and a NaN, which stays NaN.
TEST_P(OpsTest, ClampedSwiGlu) {
  const int64_t t_count = 3, inter = 37;
  const float alpha = 1.702f, limit = 7.0f;
  std::vector<float> v = Random(t_count * 2 * inter, 15, -12, 12);
  Tensor gu = Act(v, {t_count, 2 * inter});
  const std::vector<float> s = Host(gu);
  std::vector<double> ref, scale;
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t i = 0; i < inter; ++i) {
      const double g = std::min<double>(s[t * 2 * inter + i], limit);
      const double u = std::clamp<double>(s[t * 2 * inter + inter + i], -limit, limit);
      ref.push_back((u + 1) * g / (1 + std::exp(-alpha * g)));
      scale.push_back(1e-6 + std::fabs(u + 1) * std::min(1.0, std::fabs(g)));
    }
  }
  std::vector<float> nan_v = v;
  nan_v[0] = std::numeric_limits<float>::quiet_NaN();
  nan_v[inter + 1] = std::numeric_limits<float>::quiet_NaN();
  // The CPU's paths: libm on the scalar one, the vector e^x on AVX2 (rows of 37: 4 whole
  // vectors and a masked tail).
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    Tensor out;
    ClampedSwiGlu(gu, alpha, limit, &out);
    ASSERT_EQ(out.shape(), (Shape{t_count, inter}));
    ExpectClose(Host(out), ref, scale, tol(), "clamped SwiGLU " + isa_name);
    ClampedSwiGlu(Act(nan_v, {t_count, 2 * inter}), alpha, limit, &out);
    const std::vector<float> got = Host(out);
    EXPECT_TRUE(std::isnan(got[0])) << isa_name;
    EXPECT_TRUE(std::isnan(got[1])) << isa_name;
  }
}

// Mamba-2's scan on every device against the CPU kernel (whose recurrence the SelectiveScan
// tests below check) in f32 on the activations as the device holds them: three sequences of 7,
// 1 and 4 tokens, N = 20 (two whole 8-lane partial sums and a tail), twice: from fresh states,
// then sequence 1 carried on while 0 and 2 are fresh again. Outputs and the states left.
TEST_P(OpsTest, SelectiveScan) {
  const SsmConfig cfg{6, 5, 3, 20, 4};
  const int64_t inner = 30, channels = inner + 2 * 3 * 20, width = inner + channels + 6;
  const std::vector<int32_t> starts = {0, 7, 8, 12};
  auto on_device = [&](const Tensor& t) {
    return device() == Device::kCpu ? t : t.ToDevice(device());
  };
  const Tensor w = Tensor::FromVector(Random(channels * 4, 31, -0.5f, 0.5f), {channels, 4});
  const Tensor b = Tensor::FromVector(Random(channels, 32, -0.1f, 0.1f), {channels});
  const Tensor dtb = Tensor::FromVector(Random(6, 33, -1, 1), {6});
  const Tensor alog = Tensor::FromVector(Random(6, 34, -1, 1), {6});
  const Tensor dd = Tensor::FromVector(Random(6, 35, -1, 1), {6});
  std::vector<Tensor> conv, ssm, ref_conv, ref_ssm;
  for (int s = 0; s < 3; ++s) {
    conv.push_back(on_device(Tensor::Zeros({channels, 3}, DType::kF32)));
    ssm.push_back(on_device(Tensor::Zeros({6, 5, 20}, DType::kF32)));
    ref_conv.push_back(Tensor::Zeros({channels, 3}, DType::kF32));
    ref_ssm.push_back(Tensor::Zeros({6, 5, 20}, DType::kF32));
  }
  auto pointers = [](std::vector<Tensor>& v) {
    std::vector<Tensor*> p;
    for (Tensor& t : v) p.push_back(&t);
    return p;
  };
  const std::vector<std::vector<uint8_t>> fresh = {{1, 1, 1}, {1, 0, 1}};
  for (int call = 0; call < 2; ++call) {
    const Tensor proj = Act(Random(12 * width, 40 + call, -2, 2), {12, width});
    Tensor out = Act(std::vector<float>(12 * 2 * inner, 0.0f), {12, 2 * inner});
    SelectiveScan(cfg, proj, on_device(w), on_device(b), on_device(dtb), on_device(alog),
                  on_device(dd), starts, pointers(conv), pointers(ssm), fresh[call], &out);
    Tensor ref = Tensor::Zeros({12, 2 * inner}, DType::kF32);
    const std::vector<float> proj_host = Host(proj);
    cpu::SelectiveScan(cfg, Tensor::FromVector(proj_host, {12, width}), w, b, dtb, alog, dd, starts,
                       pointers(ref_conv), pointers(ref_ssm), fresh[call], &ref);
    const std::vector<float> want = Host(ref);
    const std::string what = "call " + std::to_string(call);
    ExpectClose(Host(out), std::vector<double>(want.begin(), want.end()),
                std::vector<double>(want.size(), 1.0), tol(), what + " outputs");
    for (int s = 0; s < 3; ++s) {
      for (const auto& [got, expected] :
           {std::pair{&conv[s], &ref_conv[s]}, {&ssm[s], &ref_ssm[s]}}) {
        const std::vector<float> e = Host(*expected);
        // The states stay f32 on every device: only the inputs' rounding differs (none here).
        ExpectClose(Host(*got), std::vector<double>(e.begin(), e.end()),
                    std::vector<double>(e.size(), 1.0), RelTol(DType::kF32),
                    what + " sequence " + std::to_string(s) + " states");
      }
    }
  }
}

double ActivationReference(Activation kind, double d) {
  switch (kind) {
    case Activation::kRelu:
      return d > 0 ? d : 0.0;
    case Activation::kSilu:
      return d / (1 + std::exp(-d));
    case Activation::kGeluErf:
      return 0.5 * d * (1 + std::erf(d / std::sqrt(2.0)));
    case Activation::kGeluTanh:
      return 0.5 * d * (1 + std::tanh(std::sqrt(2 / M_PI) * (d + 0.044715 * d * d * d)));
  }
  return d;
}

// Every activation on every path (libm on the scalar one, the vector e^x / tanh / erf on AVX2),
// over random values, a fine grid across where the functions bend, and values far out; NaN
// stays NaN (torch.relu keeps it too). The vector paths' rows end in masked tails (207 and 2207
// values), which go through the same lanes.
TEST_P(OpsTest, Activations) {
  std::vector<float> v = Random(200, 15, -6, 6);
  for (float big : {-30.0f, -10.0f, 0.0f, 10.0f, 30.0f, 1e4f, -1e4f}) v.push_back(big);
  const size_t nan_at = 3;
  v[nan_at] = std::nanf("");
  std::vector<float> grid = v;
  for (int i = 0; i <= 2000; ++i) grid.push_back(-10.0f + 0.01f * static_cast<float>(i));
  // f32 on the CPU: every path within 5e-7 of the exact value (scale as below); the dtype's
  // tolerance elsewhere.
  const double tight = device() == Device::kCpu ? 5e-7 : tol();
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    for (const std::vector<float>* in : {&v, &grid}) {
      for (Activation kind :
           {Activation::kGeluErf, Activation::kGeluTanh, Activation::kRelu, Activation::kSilu}) {
        Tensor x = Act(*in, {static_cast<int64_t>(in->size())});
        const std::vector<float> s = Host(x);
        std::vector<double> ref;
        for (float f : s) ref.push_back(ActivationReference(kind, f));
        Activate(kind, &x);
        std::vector<float> got = Host(x);
        const std::string what = std::string(kind == Activation::kRelu      ? "relu"
                                             : kind == Activation::kGeluErf ? "gelu erf"
                                             : kind == Activation::kSilu    ? "silu"
                                                                            : "gelu tanh") +
                                 " (" + isa_name + ", " + std::to_string(in->size()) + ")";
        EXPECT_TRUE(std::isnan(got[nan_at])) << what << " turned NaN into " << got[nan_at];
        got[nan_at] = 0;
        ref[nan_at] = 0;
        // Scale min(1, |x|): gelu(x) ~ 0 for negative x is the difference of two O(|x|)
        // quantities.
        std::vector<double> scale;
        for (float f : s) scale.push_back(std::min(1.0, std::fabs(double{f})));
        ExpectClose(got, ref, scale, tight, what);
      }
    }
  }
}

TEST_P(OpsTest, Clamp) {
  std::vector<float> v = Random(300, 19, -8, 8);
  v[7] = std::nanf("");  // torch.clamp keeps NaN: a NaN row must still fail as non-finite
  Tensor x = Act(v, {3, 100});
  const std::vector<float> s = Host(x);
  std::vector<double> ref;
  for (float f : s) ref.push_back(std::min(std::max(double{f}, -2.5), 3.0));
  Clamp(-2.5f, 3.0f, &x);
  std::vector<float> got = Host(x);
  EXPECT_TRUE(std::isnan(got[7])) << "clamp turned NaN into " << got[7];
  got[7] = 0;
  ref[7] = 0;
  ExpectClose(got, ref, std::vector<double>(ref.size(), 1.0), tol(), "clamp");
}

TEST_P(OpsTest, Scale) {
  std::vector<float> v = Random(300, 23, -8, 8);
  v[5] = std::numeric_limits<float>::infinity();  // inf and NaN pass through, as in PyTorch
  v[9] = std::nanf("");
  Tensor x = Act(v, {3, 100});
  const std::vector<float> s = Host(x);
  std::vector<double> ref;
  for (float f : s) ref.push_back(double{f} * 0.22);
  Scale(0.22f, &x);
  std::vector<float> got = Host(x);
  EXPECT_EQ(got[5], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(got[9]));
  got[5] = got[9] = 0;
  ref[5] = ref[9] = 0;
  ExpectClose(got, ref, std::vector<double>(ref.size(), 1.0), tol(), "scale");
}

TEST_P(OpsTest, SoftCap) {
  std::vector<float> v = Random(300, 29, -90, 90);
  v[5] = std::numeric_limits<float>::infinity();  // tanh saturates: +-cap; NaN stays NaN
  v[6] = -std::numeric_limits<float>::infinity();
  v[9] = std::nanf("");
  for (int i = 0; i < 100; ++i) v.push_back(-2.0f + 0.04f * static_cast<float>(i));  // near 0
  const double tight = device() == Device::kCpu ? 5e-7 : tol();
  for (const auto& [isa, isa_name] : Isas()) {
    cpu::SetIsaForTesting(isa);
    Tensor x = Act(v, {4, 100});
    const std::vector<float> s = Host(x);
    std::vector<double> ref;
    for (float f : s) ref.push_back(std::tanh(double{f} / 30.0) * 30.0);
    SoftCap(30.0f, &x);
    std::vector<float> got = Host(x);
    EXPECT_EQ(got[5], 30.0f) << isa_name;
    EXPECT_EQ(got[6], -30.0f) << isa_name;
    EXPECT_TRUE(std::isnan(got[9])) << isa_name;
    got[9] = 0;
    ref[9] = 0;
    ExpectClose(got, ref, {}, tight, "soft cap (" + isa_name + ")");
  }
}

// Two experts' weighted rows added into out in turn, as a mixture of experts sums them; rows
// no expert took stay as they were. In 16 bits the weight, each product and each sum round.
TEST_P(OpsTest, AddWeightedRows) {
  const int64_t t = 5, h = 37;
  Tensor out = Act(Random(t * h, 31, -2, 2), {t, h});
  const std::vector<float> before = Host(out);
  std::vector<double> ref(before.begin(), before.end());
  const std::vector<std::pair<std::vector<int32_t>, std::vector<float>>> experts = {
      {{4, 0, 2}, {0.7f, 0.125f, 0.3337f}}, {{2, 4}, {0.6663f, 0.3f}}};
  for (size_t e = 0; e < experts.size(); ++e) {
    const auto& [rows, weights] = experts[e];
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor src = Act(Random(n * h, 32 + static_cast<int>(e), -3, 3), {n, h});
    const std::vector<float> s = Host(src);
    Tensor w = Tensor::FromVector(weights, {n});
    if (device() != Device::kCpu) w = w.ToDevice(device());
    AddWeightedRows(src, Index(rows), w, &out);
    for (int64_t i = 0; i < n; ++i) {
      const double wi = RoundTo(act_dtype(), weights[i]);
      for (int64_t j = 0; j < h; ++j) {
        double& o = ref[rows[i] * h + j];
        o = RoundTo(act_dtype(), static_cast<float>(o + RoundTo(act_dtype(), s[i * h + j] * wi)));
      }
    }
  }
  ExpectClose(Host(out), ref, std::vector<double>(ref.size(), 4.0), tol(), "weighted rows");
  const std::vector<float> got = Host(out);
  for (int64_t j = 0; j < h; ++j) EXPECT_EQ(got[1 * h + j], ref[1 * h + j]) << "untouched row";
}

TEST_P(OpsTest, SoftmaxAndLogSoftmaxLargeMagnitudes) {
  const int64_t n = 1000;
  std::vector<float> v;
  const std::vector<float> r0 = Random(n, 16, -1e4f, 1e4f);     // huge spread
  const std::vector<float> r1 = Random(n, 17, 3e4f, 3e4f + 5);  // large offset, small spread
  std::vector<float> r2 = Random(n, 18, -20, 20);
  for (int64_t i = 0; i < n; i += 3) r2[i] = -std::numeric_limits<float>::infinity();  // masked
  v.insert(v.end(), r0.begin(), r0.end());
  v.insert(v.end(), r1.begin(), r1.end());
  v.insert(v.end(), r2.begin(), r2.end());
  for (bool log : {false, true}) {
    Tensor x = Act(v, {3, n});
    const std::vector<float> s = Host(x);
    std::vector<double> ref, scale;
    for (int64_t r = 0; r < 3; ++r) {
      double mx = -INFINITY;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double{s[r * n + i]});
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += std::exp(s[r * n + i] - mx);
      for (int64_t i = 0; i < n; ++i) {
        const double z = s[r * n + i] - mx;
        ref.push_back(log ? z - std::log(sum) : std::exp(z) / sum);
        // Absolute slack: log-softmax 1 * tol (values near 0), softmax 1e-3 * tol.
        scale.push_back(log ? 1.0 : 1e-3);
      }
    }
    if (log) {
      LogSoftmax(&x);
    } else {
      Softmax(&x);
    }
    const std::vector<float> got = Host(x);
    ExpectClose(got, ref, scale, tol(), log ? "log_softmax" : "softmax");
    if (!log) {
      for (int64_t r = 0; r < 3; ++r) {
        double total = 0;
        for (int64_t i = 0; i < n; ++i) total += got[r * n + i];
        EXPECT_NEAR(total, 1.0, 1e3 * tol());
      }
    }
  }
}

// ---- Greedy choice ------------------------------------------------------------------------

TEST_P(OpsTest, GreedyPickFirstMaximumAfterBans) {
  if (dtype() != DType::kF32) GTEST_SKIP() << "logits are f32 on every device";
  // 3001: two parts of the CUDA kernel's split (the tie spans them); 128256 (Llama 3's
  // vocabulary): the most parts, the tie between the first and the last.
  for (const int64_t v : {int64_t{3001}, int64_t{128256}}) {
    const int64_t rows = 4;
    std::vector<float> x = Random(rows * v, 60, -10, 10);
    x[0 * v + 17] = 30.0f;  // row 0: a clear winner
    x[1 * v + 5] = 25.0f;   // row 1: a tie, the first index wins
    x[1 * v + v - 101] = 25.0f;
    x[2 * v + 40] = 50.0f;  // row 2: the winner is banned (EOS before min_new_tokens)
    x[2 * v + 41] = 20.0f;
    const std::vector<int32_t> banned = {-1, -1, -1, -1, 40, -1, -1, -1};  // [R, 2]
    std::vector<int32_t> want_ids;
    std::vector<double> want_lp;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> row(x.begin() + r * v, x.begin() + (r + 1) * v);
      for (int64_t m = 0; m < 2; ++m) {
        if (banned[r * 2 + m] >= 0) row[banned[r * 2 + m]] = -INFINITY;
      }
      const int64_t best = std::max_element(row.begin(), row.end()) - row.begin();
      double sum = 0;
      for (double y : row) sum += std::exp(y - row[best]);
      want_ids.push_back(static_cast<int32_t>(best));
      want_lp.push_back(-std::log(sum));
    }
    Tensor logits = Tensor::FromVector(x, {rows, v});
    Tensor banned_t = Tensor::FromVector(banned, {rows, 2});
    if (device() != Device::kCpu) {
      logits = logits.ToDevice(device());
      banned_t = banned_t.ToDevice(device());
    }
    Tensor ids, lps;
    GreedyPick(&logits, banned_t, &ids, &lps);
    const Tensor ids_h = ids.device() == Device::kCpu ? ids : ids.ToDevice(Device::kCpu);
    EXPECT_EQ(std::vector<int32_t>(ids_h.data<int32_t>(), ids_h.data<int32_t>() + rows), want_ids);
    EXPECT_EQ(want_ids[1], 5);
    EXPECT_EQ(want_ids[2], 41);
    // log(sum of exp) over 3001 terms in f32: a few ulps of values up to ~log(3001).
    // f32 sums over 128256 terms: ten times the slack.
    ExpectClose(Host(lps), want_lp, std::vector<double>(rows, v > 10000 ? 100.0 : 10.0), 1e-6,
                "greedy logprob");
  }
}

// HF's repetition penalty: listed tokens' positive logits divided, negative ones multiplied,
// once each; rows with penalty 1 untouched, bit for bit; -1 entries and other tokens too.
TEST_P(OpsTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  if (dtype() != DType::kF32) GTEST_SKIP() << "logits are f32 on every device";
  const int64_t rows = 3, v = 1000, m = 4;
  const std::vector<float> x = Random(rows * v, 61, -5, 5);
  const std::vector<int32_t> tokens = {3, 999, -1, 500,  // row 0
                                       3, 10,  11, 12,   // row 1: penalty 1, untouched
                                       0, -1,  -1, -1};  // row 2
  const std::vector<float> penalties = {1.3f, 1.0f, 0.7f};
  std::vector<float> want = x;
  for (int64_t r = 0; r < rows; ++r) {
    if (penalties[r] == 1.0f) continue;
    for (int64_t j = 0; j < m; ++j) {
      const int32_t t = tokens[r * m + j];
      if (t < 0) continue;
      float& y = want[r * v + t];
      y = y < 0 ? y * penalties[r] : y / penalties[r];
    }
  }
  Tensor logits = Tensor::FromVector(x, {rows, v});
  Tensor tokens_t = Tensor::FromVector(tokens, {rows, m});
  Tensor penalties_t = Tensor::FromVector(penalties, {rows});
  if (device() != Device::kCpu) {
    logits = logits.ToDevice(device());
    tokens_t = tokens_t.ToDevice(device());
    penalties_t = penalties_t.ToDevice(device());
  }
  RepetitionPenalty(&logits, tokens_t, penalties_t);
  EXPECT_EQ(Host(logits), want);
}

// A row with a NaN or +inf anywhere (not only at its maximum) has no choice: id -1 and a NaN
// logprob, on every device; -inf (a banned token) is a normal value; the other rows are as
// always.
TEST_P(OpsTest, GreedyPickRefusesNonFiniteRows) {
  if (dtype() != DType::kF32) GTEST_SKIP() << "logits are f32 on every device";
  const int64_t rows = 5, v = 2049;
  std::vector<float> x = Random(rows * v, 61, -10, 10);
  x[0 * v + 1000] = NAN;        // a NaN below the row's maximum
  x[1 * v + 7] = INFINITY;      // +inf
  x[2 * v + 2048] = -INFINITY;  // -inf: an ordinary (banned-like) value
  x[2 * v + 3] = 40.0f;
  for (int64_t i = 0; i < v; ++i) x[3 * v + i] = NAN;  // all NaN
  x[4 * v + 9] = 35.0f;
  Tensor logits = Tensor::FromVector(x, {rows, v});
  if (device() != Device::kCpu) logits = logits.ToDevice(device());
  Tensor ids, lps;
  GreedyPick(&logits, Tensor(), &ids, &lps);
  const Tensor ids_h = ids.device() == Device::kCpu ? ids : ids.ToDevice(Device::kCpu);
  const std::vector<float> lps_h = Host(lps);
  EXPECT_EQ(std::vector<int32_t>(ids_h.data<int32_t>(), ids_h.data<int32_t>() + rows),
            (std::vector<int32_t>{-1, -1, 3, -1, 9}));
  for (int64_t r : {0, 1, 3}) EXPECT_TRUE(std::isnan(lps_h[r])) << r;
  for (int64_t r : {2, 4}) EXPECT_TRUE(std::isfinite(lps_h[r])) << r;
}

// TopLogits against its definition: x = logits / temperature in f32; lse = max + log of the
// double sum of exp(x - max); mass = the double sum of the f32 exp(x - lse); the count largest x
// with ties going to smaller ids (compared as (value, id) sets: the op leaves them unordered).
// Rows with tied plateaus, -inf entries, a NaN (lse NaN, ids -1), count 1, 100 and all of V.
TEST_P(OpsTest, TopLogitsAreTheLargestValuesWithTheLogSumExp) {
  if (dtype() != DType::kF32) GTEST_SKIP() << "logits are f32 on every device";
  const int64_t rows = 4, v = 3001;
  std::vector<float> x = Random(rows * v, 71, -8, 8);
  for (int64_t i = 0; i < v; i += 3) x[1 * v + i] = 2.5f;  // a plateau across the cut
  for (int64_t i = 0; i < v; i += 7) x[2 * v + i] = -INFINITY;
  x[3 * v + 1234] = NAN;
  const std::vector<int32_t> picked = {1, 3, 0, 2, 1};
  const std::vector<float> temps = {1.0f, 0.8f, 0.7f, 1.0f, 1.7f};
  for (int64_t count : {int64_t{1}, int64_t{100}, v}) {
    SCOPED_TRACE("count " + std::to_string(count));
    Tensor logits = Tensor::FromVector(x, {rows, v});
    Tensor rows_t = Tensor::FromVector(picked, {5});
    Tensor temps_t = Tensor::FromVector(temps, {5});
    if (device() != Device::kCpu) {
      logits = logits.ToDevice(device());
      rows_t = rows_t.ToDevice(device());
      temps_t = temps_t.ToDevice(device());
    }
    Tensor values, ids, stats;
    TopLogits(logits, rows_t, temps_t, count, &values, &ids, &stats);
    const std::vector<float> got_v = Host(values), got_s = Host(stats);
    const Tensor ids_h = ids.device() == Device::kCpu ? ids : ids.ToDevice(Device::kCpu);
    for (size_t i = 0; i < picked.size(); ++i) {
      const float* row = x.data() + picked[i] * v;
      std::vector<float> t(row, row + v);
      for (float& f : t) f /= temps[i];
      const int32_t* gi = ids_h.data<int32_t>() + i * count;
      if (picked[i] == 3) {  // the NaN row
        EXPECT_TRUE(std::isnan(got_s[i * 2])) << i;
        EXPECT_EQ(gi[0], -1);
        continue;
      }
      float mx = -INFINITY;
      for (float f : t) mx = std::max(mx, f);
      double sum = 0;
      for (float f : t) sum += f == -INFINITY ? 0.0 : std::exp(static_cast<double>(f - mx));
      const float lse = mx + static_cast<float>(std::log(sum));
      double mass = 0;
      for (float f : t) mass += std::exp(f - lse);
      EXPECT_NEAR(got_s[i * 2], lse, 1e-6 * std::fabs(lse) + 1e-6) << i;
      EXPECT_NEAR(got_s[i * 2 + 1], mass, 1e-6) << i;
      std::vector<std::pair<float, int32_t>> want, got;
      for (int64_t k = 0; k < v; ++k) want.push_back({t[k], static_cast<int32_t>(k)});
      std::sort(want.begin(), want.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      want.resize(count);
      for (int64_t k = 0; k < count; ++k) got.push_back({got_v[i * count + k], gi[k]});
      std::sort(got.begin(), got.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      EXPECT_EQ(got, want) << "row " << i;
    }
  }
}

// ---- Rotary -------------------------------------------------------------------------------

// HF: freqs = inv_freq (f32) * position (f32), rounded to f32; cos and sin of that.
std::vector<double> RotaryReference(const std::vector<float>& x, int64_t t_count, int64_t heads,
                                    int64_t d, int rot, RotaryStyle style,
                                    const std::vector<float>& inv,
                                    const std::vector<int32_t>& pos) {
  std::vector<double> out(x.begin(), x.end());
  const int half = rot / 2;
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = x.data() + (t * heads + h) * d;
      double* dst = out.data() + (t * heads + h) * d;
      for (int j = 0; j < half; ++j) {
        const double angle = static_cast<float>(static_cast<float>(pos[t]) * inv[j]);
        const double c = std::cos(angle), s = std::sin(angle);
        const int i1 = style == RotaryStyle::kNeox ? j : 2 * j;
        const int i2 = style == RotaryStyle::kNeox ? j + half : 2 * j + 1;
        dst[i1] = src[i1] * c - src[i2] * s;
        dst[i2] = src[i2] * c + src[i1] * s;
      }
    }
  }
  return out;
}

TEST_P(OpsTest, Rotary) {
  const int64_t t_count = 6, hq = 4, hk = 2;
  const std::vector<int32_t> pos = {0, 1, 5, 100, 4000, 37};
  struct Case {
    RotaryStyle style;
    int64_t d;
    int rot;
    const char* name;
  };
  const Case cases[] = {{RotaryStyle::kNeox, 16, 16, "neox"},
                        {RotaryStyle::kGptj, 16, 16, "gptj"},
                        {RotaryStyle::kNeox, 24, 8, "neox partial"},
                        {RotaryStyle::kGptj, 24, 8, "gptj partial"}};
  uint32_t seed = 20;
  for (const Case& c : cases) {
    RotaryConfig cfg;
    cfg.rotary_dim = c.rot;
    cfg.style = c.style;
    cfg.inv_freq = RotaryInvFreq(c.rot, 10000.0);
    Tensor q = Act(Random(t_count * hq * c.d, ++seed), {t_count, hq, c.d});
    Tensor k = Act(Random(t_count * hk * c.d, ++seed), {t_count, hk, c.d});
    const std::vector<float> qs = Host(q), ks = Host(k);
    Rotary(cfg, Index(pos), &q, &k);
    const std::vector<float> qg = Host(q), kg = Host(k);
    // Scale 1: outputs are O(1) combinations of O(1) inputs.
    const std::vector<double> one(qs.size(), 1.0), one_k(ks.size(), 1.0);
    ExpectClose(qg, RotaryReference(qs, t_count, hq, c.d, c.rot, c.style, cfg.inv_freq, pos), one,
                tol(), std::string(c.name) + " q");
    ExpectClose(kg, RotaryReference(ks, t_count, hk, c.d, c.rot, c.style, cfg.inv_freq, pos), one_k,
                tol(), std::string(c.name) + " k");
    // The non-rotary tail is untouched, bit for bit.
    for (int64_t i = 0; i < t_count * hq; ++i)
      for (int64_t j = c.rot; j < c.d; ++j) ASSERT_EQ(qg[i * c.d + j], qs[i * c.d + j]);
    // Position 0 is the identity.
    for (int64_t j = 0; j < hq * c.d; ++j) ASSERT_FLOAT_EQ(qg[j], qs[j]);
  }
}

// The fused op against the ops it stands for, bit for bit: q, and every cache slot (written
// ones and the sentinel elsewhere); a padding row (slot -1) writes nothing.
TEST_P(OpsTest, QkvToCacheIsCopyColumnsRotaryAndReshapeAndCache) {
  struct Case {
    int64_t hq, hk, d;
    int rot;  // 0: no rotary (ALiBi, learned positions)
    RotaryStyle style;
    const char* name;
  };
  const Case cases[] = {{4, 2, 16, 16, RotaryStyle::kNeox, "gqa neox"},
                        {3, 3, 24, 8, RotaryStyle::kGptj, "mha gptj partial"},
                        {4, 1, 24, 8, RotaryStyle::kNeox, "mqa neox partial"},
                        {2, 2, 16, 0, RotaryStyle::kNeox, "no rotary"}};
  const std::vector<int32_t> pos = {0, 7, 3, 4000, 37};
  const std::vector<int32_t> slots = {5, 12, -1, 3, 8};  // blocks of 4: across blocks
  const int64_t t_count = 5, num_blocks = 4, bs = 4;
  uint32_t seed = 70;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RotaryConfig cfg;
    if (c.rot > 0) {
      cfg.rotary_dim = c.rot;
      cfg.style = c.style;
      cfg.inv_freq = RotaryInvFreq(c.rot, 10000.0);
    }
    const RotaryConfig* rotary = c.rot > 0 ? &cfg : nullptr;
    const int64_t width = (c.hq + 2 * c.hk) * c.d;
    const Tensor qkv = Act(Random(t_count * width, ++seed), {t_count, width});
    auto fresh_cache = [&] {
      KvCacheLayer cache;
      const std::vector<float> sentinel(num_blocks * bs * c.hk * c.d, 512.0f);
      cache.k = Tensor::FromVector(sentinel, {num_blocks, bs, c.hk, c.d}).To(dtype());
      cache.v = cache.k.To(dtype());
      if (device() != Device::kCpu) {
        cache.k = cache.k.ToDevice(device());
        cache.v = cache.v.ToDevice(device());
      }
      return cache;
    };
    const std::vector<float> zeros_q(t_count * c.hq * c.d, 0.0f);
    const std::vector<float> zeros_kv(t_count * c.hk * c.d, 0.0f);
    // Apart.
    KvCacheLayer want_cache = fresh_cache();
    Tensor want_q = Act(zeros_q, {t_count, c.hq, c.d});
    Tensor k = Act(zeros_kv, {t_count, c.hk, c.d}), v = Act(zeros_kv, {t_count, c.hk, c.d});
    Tensor q2 = want_q.Reshape({t_count, c.hq * c.d}), k2 = k.Reshape({t_count, c.hk * c.d}),
           v2 = v.Reshape({t_count, c.hk * c.d});
    CopyColumns(qkv, 0, c.hq * c.d, &q2, 0);
    CopyColumns(qkv, c.hq * c.d, c.hk * c.d, &k2, 0);
    CopyColumns(qkv, (c.hq + c.hk) * c.d, c.hk * c.d, &v2, 0);
    if (rotary != nullptr) Rotary(cfg, Index(pos), &want_q, &k);
    ReshapeAndCache(k, v, Index(slots), &want_cache);
    // Fused.
    KvCacheLayer got_cache = fresh_cache();
    Tensor got_q = Act(zeros_q, {t_count, c.hq, c.d});
    QkvToCache(qkv, rotary, rotary != nullptr ? Index(pos) : Tensor(), Index(slots), &got_q,
               &got_cache);
    EXPECT_EQ(Host(got_q), Host(want_q));
    EXPECT_EQ(Host(got_cache.k), Host(want_cache.k));
    EXPECT_EQ(Host(got_cache.v), Host(want_cache.v));
  }
}

TEST_P(OpsTest, RotaryInvFreqDefault) {
  for (int dim : {64, 80, 128}) {
    for (double theta : {10000.0, 500000.0, 1e6}) {
      const std::vector<float> inv = RotaryInvFreq(dim, theta);
      ASSERT_EQ(inv.size(), static_cast<size_t>(dim / 2));
      EXPECT_EQ(inv[0], 1.0f);
      for (int i = 0; i < dim / 2; ++i) {
        // f32: (2i / dim) rounded, the power rounded, the reciprocal rounded: a few ulps.
        const double e = static_cast<float>(2.0f * i / dim);
        const double want = 1.0 / std::pow(theta, e);
        EXPECT_NEAR(inv[i], want, 4e-7 * want) << dim << " " << theta << " " << i;
        // And close to the exact real value (the exponent's rounding moves it by <= 1e-6).
        const double exact = 1.0 / std::pow(theta, 2.0 * i / dim);
        EXPECT_NEAR(inv[i], exact, 2e-6 * exact);
      }
    }
  }
}

TEST_P(OpsTest, RotaryInvFreqLlama3Scaling) {
  // Llama 3.1 8B: rope_theta 500000, factor 8, low 1, high 4, original 8192; head_dim 128.
  const int dim = 128;
  const double theta = 500000, factor = 8, low = 1, high = 4, old_len = 8192;
  const std::vector<float> base = RotaryInvFreq(dim, theta);
  const std::vector<float> scaled = RotaryInvFreq(dim, theta, factor, low, high, 8192);
  ASSERT_EQ(scaled.size(), base.size());
  // HF's _compute_llama3_parameters, in double.
  const double low_wavelen = old_len / low, high_wavelen = old_len / high;
  int n_high = 0, n_low = 0, n_mid = 0;
  for (int i = 0; i < dim / 2; ++i) {
    const double f = base[i];
    const double wavelen = 2 * M_PI / f;
    // The reference is only meaningful away from the thresholds (f32 vs f64 decisions).
    ASSERT_GT(std::fabs(wavelen - low_wavelen), 1e-3 * low_wavelen);
    ASSERT_GT(std::fabs(wavelen - high_wavelen), 1e-3 * high_wavelen);
    double want;
    if (wavelen < high_wavelen) {
      want = f;
      ++n_high;
      EXPECT_EQ(scaled[i], base[i]) << i;  // untouched
    } else if (wavelen > low_wavelen) {
      want = f / factor;
      ++n_low;
    } else {
      const double smooth = (old_len / wavelen - low) / (high - low);
      want = (1 - smooth) * f / factor + smooth * f;
      ++n_mid;
    }
    EXPECT_NEAR(scaled[i], want, 1e-6 * want) << i;
  }
  // All three regimes occur for these parameters.
  EXPECT_GT(n_high, 0);
  EXPECT_GT(n_low, 0);
  EXPECT_GT(n_mid, 0);
}

// ---- ALiBi --------------------------------------------------------------------------------

// BLOOM's formula: p = 2^floor(log2 n); slopes base^k for k = 1..p with base = 2^(-8/p), then
// extra^(2k+1) for the remaining heads with extra = 2^(-4/p). BLOOM makes base and extra f32
// tensors, so they are rounded to f32 here; the powers are exact (double).
std::vector<double> AlibiReference(int n) {
  int p = 1 << static_cast<int>(std::floor(std::log2(n)));
  const double base = static_cast<float>(std::pow(2.0, -8.0 / p));
  const double extra = static_cast<float>(std::pow(2.0, -4.0 / p));
  std::vector<double> s;
  for (int k = 1; k <= p; ++k) s.push_back(std::pow(base, k));
  for (int k = 0; k < std::min(p, n - p); ++k) s.push_back(std::pow(extra, 2 * k + 1));
  return s;
}

TEST_P(OpsTest, AlibiSlopes) {
  const std::vector<float> s8 = AlibiSlopes(8);
  ASSERT_EQ(s8.size(), 8u);
  for (int k = 0; k < 8; ++k) EXPECT_EQ(s8[k], std::ldexp(1.0f, -(k + 1)));  // 1/2 .. 1/256
  const std::vector<float> s12 = AlibiSlopes(12);
  ASSERT_EQ(s12.size(), 12u);
  // 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (BLOOM's powers of an f32 base carry
  // up to ~7 ulps of that base's rounding: 1e-6).
  const double known12[12] = {0.5,
                              0.25,
                              0.125,
                              0.0625,
                              0.03125,
                              0.015625,
                              0.0078125,
                              0.00390625,
                              0.70710678118654752,
                              0.35355339059327376,
                              0.17677669529663688,
                              0.08838834764831844};
  for (int k = 0; k < 12; ++k) EXPECT_NEAR(s12[k], known12[k], 1e-6 * known12[k]) << k;
  for (int n : {1, 5, 12, 16, 20, 32, 40, 112}) {
    const std::vector<float> got = AlibiSlopes(n);
    const std::vector<double> want = AlibiReference(n);
    ASSERT_EQ(got.size(), want.size()) << n;
    for (int k = 0; k < n; ++k) EXPECT_NEAR(got[k], want[k], 1e-7 * want[k]) << n << " " << k;
  }
}

// ---- Paged KV cache and attention ---------------------------------------------------------

struct AttnCase {
  int64_t hq, hk;
  int window;
  bool alibi;
  // Contexts of ~1-2k keys: several key chunks per block and several partitions per row on
  // CUDA (its flash-decoding path), not only one.
  bool long_context = false;
  bool causal = true;
  // T5 relative position buckets (32 buckets up to distance 128, or 1000 on long contexts).
  bool relative = false;
  bool bidirectional = false;
  int64_t d = 16;
  // > 0: the first sequence is a whole prefill of this many tokens (several CPU tasks of
  // query rows) instead of 5.
  int64_t long_prefill = 0;
  // > 0: Gemma 2's soft cap on the scaled logits (AttentionBias::softcap).
  float softcap = 0;
  // GPT-OSS's attention sinks, one logit per head in the softmax's denominator.
  bool sinks = false;
};

void RunAttention(OpsTest* test, const AttnCase& c, DType cache_dtype, Device device, double tol) {
  // A prefill (q_len 5, ctx 5), a decode (q_len 1, ctx 37: 5 blocks), a chunk of a longer
  // prompt (q_len 3, ctx 20); or, long, a decode at 1700 and a chunk at 1300.
  const int64_t first_len = c.long_prefill > 0 ? c.long_prefill : 5;
  const std::vector<int64_t> q_lens = {first_len, 1, 3};
  const std::vector<int64_t> ctxs = c.long_context ? std::vector<int64_t>{first_len, 1700, 1300}
                                                   : std::vector<int64_t>{first_len, 37, 20};
  const int64_t d = c.d, bs = 8;
  int64_t num_blocks = 0, max_blocks = 0;
  for (int64_t ctx : ctxs) {
    num_blocks += (ctx + bs - 1) / bs;
    max_blocks = std::max(max_blocks, (ctx + bs - 1) / bs + 1);  // + an unused entry
  }
  num_blocks += 3;  // blocks no sequence owns
  const int64_t num_seqs = 3;
  // Non-contiguous, shuffled block tables; unused entries are -1.
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(99));
  std::vector<int32_t> tables(num_seqs * max_blocks, -1);
  int next = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t b = 0; b < (ctxs[s] + bs - 1) / bs; ++b) tables[s * max_blocks + b] = perm[next++];

  // Keys/values for every context position of every sequence, and the slot of each.
  std::vector<std::vector<float>> keys(num_seqs), values(num_seqs);
  auto slot_of = [&](int64_t s, int64_t pos) {
    return static_cast<int32_t>(tables[s * max_blocks + pos / bs] * bs + pos % bs);
  };
  uint32_t seed = 100;
  for (int64_t s = 0; s < num_seqs; ++s) {
    keys[s] = Random(ctxs[s] * c.hk * d, ++seed);
    values[s] = Random(ctxs[s] * c.hk * d, ++seed);
  }
  auto rows = [&](const std::vector<std::vector<float>>& src, bool new_tokens,
                  std::vector<int32_t>* slots) {
    std::vector<float> out;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t first_new = ctxs[s] - q_lens[s];
      for (int64_t p = new_tokens ? first_new : 0; p < (new_tokens ? ctxs[s] : first_new); ++p) {
        out.insert(out.end(), src[s].begin() + p * c.hk * d, src[s].begin() + (p + 1) * c.hk * d);
        if (slots) slots->push_back(slot_of(s, p));
      }
    }
    return out;
  };

  // The cache starts out full of a sentinel.
  const float kSentinel = 512.0f;  // exact in bf16 and f16
  const int64_t cache_elems = num_blocks * bs * c.hk * d;
  KvCacheLayer cache;
  cache.k =
      Tensor::FromVector(std::vector<float>(cache_elems, kSentinel), {num_blocks, bs, c.hk, d})
          .To(cache_dtype);
  cache.v = cache.k.To(cache_dtype);
  if (device != Device::kCpu) {
    cache.k = cache.k.ToDevice(device);
    cache.v = cache.v.ToDevice(device);
  }

  // Step 1: the past tokens. Step 2: the new ones, plus a padding row with slot -1.
  std::vector<int32_t> past_slots, new_slots;
  const std::vector<float> kp = rows(keys, false, &past_slots), vp = rows(values, false, nullptr);
  const int64_t n_past = static_cast<int64_t>(past_slots.size());
  ReshapeAndCache(test->Act(kp, {n_past, c.hk, d}), test->Act(vp, {n_past, c.hk, d}),
                  test->Index(past_slots), &cache);
  std::vector<float> kn = rows(keys, true, &new_slots), vn = rows(values, true, nullptr);
  const int64_t t_count = static_cast<int64_t>(new_slots.size());
  const std::vector<float> junk(c.hk * d, -5.0f);
  kn.insert(kn.end(), junk.begin(), junk.end());
  vn.insert(vn.end(), junk.begin(), junk.end());
  new_slots.push_back(-1);
  ReshapeAndCache(test->Act(kn, {t_count + 1, c.hk, d}), test->Act(vn, {t_count + 1, c.hk, d}),
                  test->Index(new_slots), &cache);
  new_slots.pop_back();

  // The cache holds exactly the tokens, as stored in its dtype, in their slots.
  const std::vector<float> ck = OpsTest::Host(cache.k), cv = OpsTest::Host(cache.v);
  std::vector<bool> used(num_blocks * bs, false);
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t p = 0; p < ctxs[s]; ++p) {
      const int64_t slot = slot_of(s, p);
      used[slot] = true;
      for (int64_t i = 0; i < c.hk * d; ++i) {
        ASSERT_EQ(ck[slot * c.hk * d + i], RoundTo(cache_dtype, keys[s][p * c.hk * d + i]));
        ASSERT_EQ(cv[slot * c.hk * d + i], RoundTo(cache_dtype, values[s][p * c.hk * d + i]));
      }
    }
  }
  for (int64_t slot = 0; slot < num_blocks * bs; ++slot) {
    if (!used[slot]) {
      ASSERT_EQ(ck[slot * c.hk * d], kSentinel) << "slot " << slot;
    }
  }

  // Attention.
  std::vector<int32_t> query_start = {0};
  for (int64_t s = 0; s < num_seqs; ++s)
    query_start.push_back(query_start.back() + static_cast<int32_t>(q_lens[s]));
  AttentionBatch batch;
  batch.query_start = test->Index(query_start);
  batch.context_lens = test->Index({static_cast<int32_t>(ctxs[0]), static_cast<int32_t>(ctxs[1]),
                                    static_cast<int32_t>(ctxs[2])});
  batch.block_tables = Tensor::FromVector(tables, {num_seqs, max_blocks});
  if (device != Device::kCpu) batch.block_tables = batch.block_tables.ToDevice(device);
  batch.block_size = static_cast<int>(bs);
  Tensor q = test->Act(Random(t_count * c.hq * d, 7), {t_count, c.hq, d});
  const std::vector<float> qs = OpsTest::Host(q);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  batch.causal = c.causal;
  const std::vector<float> slopes = AlibiSlopes(static_cast<int>(c.hq));
  AttentionBias bias;
  bias.softcap = c.softcap;
  if (c.alibi) bias.alibi_slopes = slopes;
  // Sinks from well below to well above these logits (~0.33 rms), so they take from a little
  // to most of the weight.
  const std::vector<float> sinks = Random(c.hq, 31, -2, 3);
  if (c.sinks) bias.sinks = sinks;
  const int buckets = 32, max_distance = c.long_context ? 1000 : 128;
  const std::vector<float> table = Random(c.hq * buckets, 23, -2, 2);
  if (c.relative) {
    bias.relative_table = Tensor::FromVector(table, {c.hq, buckets});
    if (device != Device::kCpu) bias.relative_table = bias.relative_table.ToDevice(device);
    bias.num_buckets = buckets;
    bias.max_distance = max_distance;
    bias.bidirectional = c.bidirectional;
  }
  // Dense reference from the same K/V (as the cache stores them), in double.
  std::vector<double> ref, mag;
  const int64_t group = c.hq / c.hk;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t i = 0; i < q_lens[s]; ++i) {
      const int64_t row = query_start[s] + i;
      const int64_t qpos = ctxs[s] - q_lens[s] + i;
      for (int64_t h = 0; h < c.hq; ++h) {
        const int64_t kvh = h / group;
        std::vector<double> logits;
        std::vector<int64_t> keys_seen;
        for (int64_t j = 0; j < (c.causal ? qpos + 1 : ctxs[s]); ++j) {
          if (c.window > 0 && j <= qpos - c.window) continue;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x)
            dot += double{qs[(row * c.hq + h) * d + x]} *
                   RoundTo(cache_dtype, keys[s][(j * c.hk + kvh) * d + x]);
          double l = dot * scale;
          if (c.softcap > 0) l = std::tanh(l / c.softcap) * c.softcap;
          if (c.alibi) l += double{slopes[h]} * static_cast<double>(j - qpos);
          if (c.relative) {
            l +=
                table[h * buckets + RelativePositionBucket(static_cast<int>(j - qpos),
                                                           c.bidirectional, buckets, max_distance)];
          }
          logits.push_back(l);
          keys_seen.push_back(j);
        }
        double mx = *std::max_element(logits.begin(), logits.end());
        if (c.sinks) mx = std::max(mx, double{sinks[h]});
        double sum = c.sinks ? std::exp(sinks[h] - mx) : 0;
        for (double& l : logits) sum += (l = std::exp(l - mx));
        for (int64_t x = 0; x < d; ++x) {
          double o = 0, m = 0;
          for (size_t n = 0; n < keys_seen.size(); ++n) {
            const double v = RoundTo(cache_dtype, values[s][(keys_seen[n] * c.hk + kvh) * d + x]);
            o += logits[n] / sum * v;
            m += logits[n] / sum * std::fabs(v);
          }
          ref.push_back(o);
          mag.push_back(m + 1e-3);
        }
      }
    }
  }
  for (const auto& [isa, isa_name] : test->Isas()) {  // the CPU's vector and scalar paths
    cpu::SetIsaForTesting(isa);
    Tensor out;
    PagedAttention(q, cache, batch, scale, c.window,
                   c.alibi || c.relative || c.softcap > 0 || c.sinks ? &bias : nullptr, &out);
    ASSERT_EQ(out.shape(), (Shape{t_count, c.hq, d}));
    ExpectClose(OpsTest::Host(out), ref, mag, tol, "paged attention " + isa_name);
  }
}

TEST_P(OpsTest, PagedAttentionMha) {
  RunAttention(this, {4, 4, 0, false}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionGqa) {
  RunAttention(this, {8, 2, 0, false}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionMqa) {
  RunAttention(this, {4, 1, 0, false}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionSlidingWindow) {
  RunAttention(this, {8, 2, 6, false}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionAlibi) {
  RunAttention(this, {4, 4, 0, true}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionAlibiSlidingWindowMqa) {
  RunAttention(this, {8, 1, 4, true}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionLongContexts) {
  RunAttention(this, {8, 2, 0, false, true}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionLongContextsSlidingWindowAlibi) {
  RunAttention(this, {4, 4, 700, true, true}, dtype(), device(), tol());
}
// Gemma 2's soft cap, at a cap (0.2) that bends these logits (q.k / sqrt(d) ~ 0.33 rms):
// alone, with a window, ALiBi and GQA 8 over a 70-token prefill, and at the long contexts and
// head sizes of CUDA's tiled and flash-decoding kernels.
TEST_P(OpsTest, PagedAttentionSoftCap) {
  AttnCase c{8, 2, 0, false};
  c.softcap = 0.2f;
  RunAttention(this, c, dtype(), device(), tol());
  AttnCase g{16, 2, 24, true};
  g.d = 64;
  g.long_prefill = 70;
  g.softcap = 0.2f;
  RunAttention(this, g, dtype(), device(), tol());
  for (int64_t d : {64, 256}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    AttnCase l{8, 4, 0, false, /*long_context=*/true};
    l.d = d;
    l.long_prefill = 100;
    l.softcap = 0.2f;
    RunAttention(this, l, dtype(), device(), tol());
  }
}
// GPT-OSS's attention sinks: alone with GQA, with its sliding window over a 70-token prefill,
// at long contexts, and on the scalar path's head size.
TEST_P(OpsTest, PagedAttentionSinks) {
  AttnCase c{8, 2, 0, false};
  c.sinks = true;
  RunAttention(this, c, dtype(), device(), tol());
  AttnCase w{16, 2, 24, false};
  w.d = 64;
  w.long_prefill = 70;
  w.sinks = true;
  RunAttention(this, w, dtype(), device(), tol());
  AttnCase l{8, 4, 128, false, /*long_context=*/true};
  l.d = 64;
  l.sinks = true;
  RunAttention(this, l, dtype(), device(), tol());
  AttnCase odd{4, 4, 0, false};
  odd.d = 20;
  odd.sinks = true;
  RunAttention(this, odd, dtype(), device(), tol());
}
// The head sizes models use (the CPU's vector path takes multiples of 8, others the scalar
// path), GQA ratios up to 8, and a 70-token prefill (query rows over several tasks).
TEST_P(OpsTest, PagedAttentionHeadDims) {
  for (int64_t d : {64, 80, 96, 128, 256, 20}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    AttnCase c{8, 2, 0, false};
    c.d = d;
    RunAttention(this, c, dtype(), device(), tol());
  }
}
TEST_P(OpsTest, PagedAttentionLongPrefillGqa8) {
  AttnCase c{16, 2, 0, false};
  c.d = 64;
  c.long_prefill = 70;
  RunAttention(this, c, dtype(), device(), tol());
  c.window = 24;
  c.alibi = true;
  RunAttention(this, c, dtype(), device(), tol());
}
// Prefill-shaped batches (CUDA's tiled kernel: 8 or more query rows per sequence): a 100-token
// prompt (7 tiles, the last partial) beside a decode at 1700 and a chunk at 1300 (one tile
// each, over many key chunks), at the head sizes the tiled kernel takes; with a window and
// ALiBi; and not causal (an encoder's prompt).
TEST_P(OpsTest, PagedAttentionTiledPrefill) {
  for (int64_t d : {64, 80, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    AttnCase c{8, 2, 0, false, /*long_context=*/true};
    c.d = d;
    c.long_prefill = 100;
    RunAttention(this, c, dtype(), device(), tol());
  }
  AttnCase c{4, 1, 40, true, /*long_context=*/true};
  c.d = 64;
  c.long_prefill = 100;
  RunAttention(this, c, dtype(), device(), tol());
  AttnCase e{8, 2, 0, false, false, /*causal=*/false};
  e.d = 64;
  e.long_prefill = 100;
  RunAttention(this, e, dtype(), device(), tol());
}
// A prompt's attention is the same, bit for bit, alone and beside decode rows and a short chunk
// (on CUDA a sequence's own length picks its kernel, tiled or per row, not its batch's: five
// decodes, the prompt and the chunk average 7 rows a sequence).
TEST_P(OpsTest, PagedAttentionPromptIsBatchInvariant) {
  const int64_t hq = 4, hk = 2, d = 64, bs = 16, num_blocks = 7, len = 40, decodes = 5;
  KvCacheLayer cache;
  cache.k = Weight(Random(num_blocks * bs * hk * d, 3), {num_blocks, bs, hk, d});
  cache.v = Weight(Random(num_blocks * bs * hk * d, 4), {num_blocks, bs, hk, d});
  const std::vector<float> q_prompt = Random(len * hq * d, 5),
                           q_decodes = Random(decodes * hq * d, 6), q_chunk = Random(5 * hq * d, 7);
  const auto attend = [&](const std::vector<float>& q, const std::vector<int32_t>& query_start,
                          const std::vector<int32_t>& context_lens,
                          const std::vector<int32_t>& tables) {
    AttentionBatch batch;
    batch.query_start = Index(query_start);
    batch.context_lens = Index(context_lens);
    const int64_t seqs = static_cast<int64_t>(context_lens.size());
    batch.block_tables = Index(tables).Reshape({seqs, static_cast<int64_t>(tables.size()) / seqs});
    batch.block_size = static_cast<int>(bs);
    Tensor out;
    PagedAttention(Act(q, {query_start.back(), hq, d}), cache, batch, 0.125f, 0, nullptr, &out);
    return Host(out);
  };
  // The prompt in blocks 0-2; the decodes at 30 in blocks 3-4; the chunk ending at 20 in 5-6.
  const std::vector<float> alone = attend(q_prompt, {0, 40}, {40}, {0, 1, 2});
  std::vector<float> q = q_decodes;
  q.insert(q.end(), q_prompt.begin(), q_prompt.end());
  q.insert(q.end(), q_chunk.begin(), q_chunk.end());
  const std::vector<float> mixed =
      attend(q, {0, 1, 2, 3, 4, 5, 45, 50}, {30, 30, 30, 30, 30, 40, 20},
             {3, 4, -1, 3, 4, -1, 3, 4, -1, 3, 4, -1, 3, 4, -1, 0, 1, 2, 5, 6, -1});
  ASSERT_EQ(alone.size(), static_cast<size_t>(len * hq * d));
  for (size_t i = 0; i < alone.size(); ++i) {
    ASSERT_EQ(alone[i], mixed[decodes * hq * d + i]) << "element " << i;
  }
}

// Encoders and cross-attention: every query sees the whole context.
// A decode row's attention has the same bits alone as in a batch: on CUDA a batch this large
// queues blocks on every SM and takes the grouped kernel's staged rows (shared memory filled by
// cp.async), a row alone its four direct loads in flight; contexts of one to three partitions,
// the longest setting the batch's partition count.
TEST_P(OpsTest, PagedAttentionDecodeIsBatchInvariant) {
  if (device() == Device::kCpu && dtype() != DType::kF32) GTEST_SKIP() << "same as Cpu_F32";
  const int64_t hq = 8, hk = 4, d = 64, bs = 16, rows = 72, longest = 600;
  const int64_t blocks = (longest + bs - 1) / bs;
  KvCacheLayer cache;
  cache.k = Weight(Random(blocks * bs * hk * d, 61), {blocks, bs, hk, d});
  cache.v = Weight(Random(blocks * bs * hk * d, 62), {blocks, bs, hk, d});
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<float> q = Random(rows * hq * d, 63);
  const auto attend = [&](int64_t r0, int64_t n, const std::vector<int32_t>& contexts) {
    std::vector<int32_t> query_start, tables;
    for (int64_t i = 0; i <= n; ++i) query_start.push_back(static_cast<int32_t>(i));
    for (int64_t i = 0; i < n; ++i) tables.insert(tables.end(), table.begin(), table.end());
    AttentionBatch batch;
    batch.query_start = Index(query_start);
    batch.context_lens = Index(contexts);
    batch.block_tables = Index(tables).Reshape({n, blocks});
    batch.block_size = static_cast<int>(bs);
    const std::vector<float> qs(q.begin() + r0 * hq * d, q.begin() + (r0 + n) * hq * d);
    Tensor out;
    PagedAttention(Act(qs, {n, hq, d}), cache, batch, 0.125f, 0, nullptr, &out);
    return Host(out);
  };
  std::vector<int32_t> contexts;
  for (int64_t r = 0; r < rows; ++r)
    contexts.push_back(r == 5 ? longest : static_cast<int32_t>(1 + (r * 97) % longest));
  const std::vector<float> all = attend(0, rows, contexts);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> alone = attend(r, 1, {contexts[r]});
    for (int64_t i = 0; i < hq * d; ++i) {
      ASSERT_EQ(alone[i], all[r * hq * d + i])
          << "row " << r << " (context " << contexts[r] << ") element " << i;
    }
  }
}

TEST_P(OpsTest, PagedAttentionNotCausal) {
  RunAttention(this, {8, 2, 0, false, false, /*causal=*/false}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionRelativeBucketsDecoder) {
  RunAttention(this, {4, 4, 0, false, false, true, /*relative=*/true}, dtype(), device(), tol());
}
TEST_P(OpsTest, PagedAttentionRelativeBucketsEncoder) {
  RunAttention(this, {4, 4, 0, false, false, false, true, /*bidirectional=*/true}, dtype(),
               device(), tol());
}
TEST_P(OpsTest, PagedAttentionRelativeBucketsLongContexts) {
  RunAttention(this, {4, 4, 0, false, true, false, true, true}, dtype(), device(), tol());
  RunAttention(this, {4, 2, 0, false, true, true, true, false}, dtype(), device(), tol());
}

// transformers' _relative_position_bucket for every relative position in [-1200, 1200]
// (tests/fixtures/relative_buckets.json, made by make_relative_bucket_fixture.py).
TEST(RelativePositionBucket, MatchesTransformers) {
  std::ifstream in(std::string(TGIS_FIXTURES_DIR) + "/relative_buckets.json");
  ASSERT_TRUE(in.good());
  const nlohmann::json cases = nlohmann::json::parse(in);
  ASSERT_EQ(cases.size(), 6u);
  for (const nlohmann::json& c : cases) {
    const int first = c["first"].get<int>();
    const std::vector<int> want = c["buckets"].get<std::vector<int>>();
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const int rel = first + static_cast<int>(i);
      const int got =
          RelativePositionBucket(rel, c["bidirectional"].get<bool>(), c["num_buckets"].get<int>(),
                                 c["max_distance"].get<int>());
      if (got != want[i] && ++bad <= 5) ADD_FAILURE() << c.dump().substr(0, 60) << " rel " << rel;
    }
    EXPECT_EQ(bad, 0);
  }
}

// ---- The CPU thread pool ------------------------------------------------------------------

// A query row's attention output is bitwise the same whether its sequence runs alone, beside
// another sequence, as two chunks of its prompt (chunked prefill, prefix caching) or as a
// decode step (the decode path, which splits the work by positions where prompts split it by
// KV heads), on every CPU path and cache dtype: rows that share a task never change each
// other's sums. The prompt is 300 tokens, so the p * v sums span three 128-key partitions.
// Parameters: the cache's dtype and (query heads, KV heads): GQA groups of 4, 8, 2, 3 and 1 (the
// decode path takes 4, 4, 2, 1 and 1 rows of a group at a time).
class CpuAttention
    : public ::testing::TestWithParam<std::tuple<DType, std::pair<int64_t, int64_t>>> {};

TEST_P(CpuAttention, RowsDoNotDependOnTheirBatchOrChunks) {
  const DType dtype = std::get<0>(GetParam());
  // Plain variables, not a structured binding: clang's C++20 lambdas cannot capture those.
  const int64_t hq = std::get<1>(GetParam()).first, hk = std::get<1>(GetParam()).second;
  const int64_t d = 64, bs = 16, len = 300, other = 50;
  const int64_t num_blocks = (len + bs - 1) / bs + (other + bs - 1) / bs;
  KvCacheLayer cache{Tensor::Zeros({num_blocks, bs, hk, d}, dtype, Device::kCpu),
                     Tensor::Zeros({num_blocks, bs, hk, d}, dtype, Device::kCpu)};
  // Sequence A owns the first blocks (reversed), B the rest.
  const int64_t a_blocks = (len + bs - 1) / bs, b_blocks = num_blocks - a_blocks;
  std::vector<int32_t> a_table, b_table;
  for (int64_t b = 0; b < a_blocks; ++b) a_table.push_back(static_cast<int32_t>(a_blocks - 1 - b));
  for (int64_t b = 0; b < b_blocks; ++b) b_table.push_back(static_cast<int32_t>(a_blocks + b));
  auto slots = [&](const std::vector<int32_t>& table, int64_t n) {
    std::vector<int32_t> out;
    for (int64_t p = 0; p < n; ++p)
      out.push_back(static_cast<int32_t>(table[p / bs] * bs + p % bs));
    return out;
  };
  ReshapeAndCache(Tensor::FromVector(Random(len * hk * d, 1), {len, hk, d}),
                  Tensor::FromVector(Random(len * hk * d, 2), {len, hk, d}),
                  Tensor::FromVector(slots(a_table, len), {len}), &cache);
  ReshapeAndCache(Tensor::FromVector(Random(other * hk * d, 3), {other, hk, d}),
                  Tensor::FromVector(Random(other * hk * d, 4), {other, hk, d}),
                  Tensor::FromVector(slots(b_table, other), {other}), &cache);
  const std::vector<float> qa = Random(len * hq * d, 5), qb = Random(hq * d, 6);
  const int64_t max_blocks = std::max(a_blocks, b_blocks);
  auto table_row = [&](const std::vector<int32_t>& t) {
    std::vector<int32_t> row(t);
    row.resize(max_blocks, -1);
    return row;
  };
  // Runs sequences (query rows, context) and returns the outputs, concatenated.
  struct Seq {
    const float* q;
    int64_t q_len, ctx;
    const std::vector<int32_t>* table;
  };
  auto run = [&](const std::vector<Seq>& seqs, int window) {
    std::vector<float> q;
    std::vector<int32_t> starts = {0}, ctxs, tables;
    for (const Seq& sq : seqs) {
      q.insert(q.end(), sq.q, sq.q + sq.q_len * hq * d);
      starts.push_back(starts.back() + static_cast<int32_t>(sq.q_len));
      ctxs.push_back(static_cast<int32_t>(sq.ctx));
      const std::vector<int32_t> row = table_row(*sq.table);
      tables.insert(tables.end(), row.begin(), row.end());
    }
    AttentionBatch batch;
    batch.query_start = Tensor::FromVector(starts, {static_cast<int64_t>(starts.size())});
    batch.context_lens = Tensor::FromVector(ctxs, {static_cast<int64_t>(ctxs.size())});
    batch.block_tables =
        Tensor::FromVector(tables, {static_cast<int64_t>(seqs.size()), max_blocks});
    batch.block_size = static_cast<int>(bs);
    Tensor out;
    PagedAttention(Tensor::FromVector(q, {starts.back(), hq, d}), cache, batch, 0.125f, window,
                   nullptr, &out);
    return OpsTest::Host(out);
  };
  auto Bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (const cpu::Isa isa : {cpu::Isa::kScalar, cpu::Isa::kAvx2}) {
    if (!cpu::IsaAvailable(isa)) continue;
    cpu::SetIsaForTesting(isa);
    for (int window : {0, 24, 150}) {
      SCOPED_TRACE("isa " + std::to_string(static_cast<int>(isa)) + " window " +
                   std::to_string(window));
      const std::vector<float> alone = run({{qa.data(), len, len, &a_table}}, window);
      std::vector<float> batched =
          run({{qb.data(), 1, other, &b_table}, {qa.data(), len, len, &a_table}}, window);
      // B's decode row beside A's prompt (the per-task path) and alone (the decode path).
      const std::vector<float> b_alone = run({{qb.data(), 1, other, &b_table}}, window);
      for (int64_t i = 0; i < hq * d; ++i)
        ASSERT_EQ(Bits(b_alone[i]), Bits(batched[i])) << "B's decode row, element " << i;
      batched.erase(batched.begin(), batched.begin() + hq * d);
      const int64_t cut = 137;
      std::vector<float> chunked = run({{qa.data(), cut, cut, &a_table}}, window);
      const std::vector<float> rest =
          run({{qa.data() + cut * hq * d, len - cut, len, &a_table}}, window);
      chunked.insert(chunked.end(), rest.begin(), rest.end());
      ASSERT_EQ(alone.size(), static_cast<size_t>(len * hq * d));
      for (size_t i = 0; i < alone.size(); ++i) {
        ASSERT_EQ(Bits(alone[i]), Bits(batched[i])) << "batched, element " << i;
        ASSERT_EQ(Bits(alone[i]), Bits(chunked[i])) << "chunked, element " << i;
      }
      // Positions as decode steps, alone and as a batch with B's row (every position a
      // decode path item could start or end at: partition and chunk edges, a window's start).
      const std::vector<int64_t> positions = {0, 3, 31, 127, 128, 200, 255, 256, 299};
      std::vector<Seq> steps = {{qb.data(), 1, other, &b_table}};
      for (int64_t p : positions) {
        const std::vector<float> step = run({{qa.data() + p * hq * d, 1, p + 1, &a_table}}, window);
        for (int64_t i = 0; i < hq * d; ++i) {
          ASSERT_EQ(Bits(alone[p * hq * d + i]), Bits(step[i]))
              << "decode at " << p << ", element " << i;
        }
        steps.push_back({qa.data() + p * hq * d, 1, p + 1, &a_table});
      }
      const std::vector<float> stepped = run(steps, window);
      for (size_t k = 0; k < positions.size(); ++k) {
        for (int64_t i = 0; i < hq * d; ++i) {
          ASSERT_EQ(Bits(alone[positions[k] * hq * d + i]), Bits(stepped[(k + 1) * hq * d + i]))
              << "batched decode at " << positions[k] << ", element " << i;
        }
      }
    }
  }
  cpu::SetIsaForTesting(cpu::Isa::kAuto);
}

using HeadCounts = std::pair<int64_t, int64_t>;

std::string CpuAttentionName(const ::testing::TestParamInfo<std::tuple<DType, HeadCounts>>& info) {
  const HeadCounts heads = std::get<1>(info.param);
  return std::string(tgis::kernels::DTypeName(std::get<0>(info.param))) + "_hq" +
         std::to_string(heads.first) + "_hk" + std::to_string(heads.second);
}

INSTANTIATE_TEST_SUITE_P(
    CacheDTypesAndGroups, CpuAttention,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(HeadCounts{8, 2}, HeadCounts{16, 2}, HeadCounts{8, 4},
                                         HeadCounts{6, 2}, HeadCounts{4, 4})),
    CpuAttentionName);

// The opt-in int8-activation kernels compute exactly what their definition says: x rounded
// per 32 stored columns to nearbyint(x * 127 / absmax), times absmax / 127, against the
// dequantized weight. That is decode (T <= 16: the streaming kernels) and the prefill GEMM
// (T = 40, over a whole panel of 32 rows plus a partial one), for 8- and 4-bit codes.
// A row's result is bitwise the same at any T on each path (4-bit codes on AVX2: across decode
// and prefill too, one kernel); off, Linear is bitwise the exact kernel again.
TEST(CpuInt8Activations, EqualsTheRoundedActivationsReference) {
  if (!cpu::Int8ActivationsAvailable()) GTEST_SKIP() << "no AVX2 on this CPU";
  const int64_t out_f = 37, in = 384;
  int isas_run = 0;
  // 4-bit decode takes the panels on both ISAs, through vpdpbusd with VNNI (from T = 5 two
  // panels a 16-lane vector: T = 7 takes tiles of 4, 2 and 1 tokens): the same integer sums,
  // so the same bits. AVX2's results by case, for the VNNI pass to compare.
  std::map<std::string, std::vector<float>> panels_avx2;
  for (const cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512Vnni}) {
    if (!cpu::IsaAvailable(isa)) {
      std::printf("[ SKIPPED  ] the AVX-512 VNNI build: not on this CPU\n");
      continue;
    }
    cpu::SetIsaForTesting(isa);
    ++isas_run;
    std::mt19937 case_rng(5);  // the same weights and x on each ISA
    for (int bits : {4, 8})
      for (int64_t t_count : {3, 7, 40})
        for (int64_t group : {32, 64, 128, 384})
          for (bool f16_scales : {false, true}) {
            const std::string key = std::to_string(bits) + "/" + std::to_string(t_count) + "/" +
                                    std::to_string(group) + "/" + std::to_string(f16_scales);
            SCOPED_TRACE(std::string(isa == cpu::Isa::kAvx2 ? "AVX2, " : "VNNI, ") +
                         std::to_string(bits) + " bits, T " + std::to_string(t_count) + ", group " +
                         std::to_string(group) + (f16_scales ? ", f16 scales" : ""));
            const int64_t groups = in / group;
            std::vector<uint8_t> codes(out_f * in);
            for (uint8_t& c : codes) c = static_cast<uint8_t>(case_rng() % (1u << bits));
            std::vector<int32_t> group_of(in);
            for (int64_t k = 0; k < in; ++k) group_of[k] = static_cast<int32_t>(k / group);
            std::vector<float> scales = Random(out_f * groups, 11, 0.001f, 0.05f),
                               zeros(out_f * groups);
            for (float& z : zeros) z = static_cast<float>(case_rng() % (1u << bits));
            if (f16_scales) {
              for (float& s : scales) s = F16ToF32(F32ToF16(s));
            }
            const Tensor w = Tensor::Quantized(std::make_shared<const QuantizedWeight>(
                BuildQuantized(bits, out_f, in, codes, group_of, groups, scales, zeros)));
            ASSERT_EQ(w.quantized()->compact(), bits == 4 && f16_scales);
            const std::vector<float> dense = OpsTest::Host(Dequantize(*w.quantized()));
            std::vector<float> xs = Random(t_count * in, 12, -2, 2);
            for (int64_t k = 0; k < in; k += 37) xs[k] *= 40;  // blocks of very different ranges
            for (int64_t k = 2 * in; k < 2 * in + 32; ++k) xs[k] = 0;  // a block of zeros
            const std::vector<float> bias = Random(out_f, 13);
            const Tensor x = Tensor::FromVector(xs, {t_count, in});
            const Tensor b = Tensor::FromVector(bias, {out_f});
            // Rows [1, T) on their own: row t of it is row t + 1 of the whole.
            const int64_t skip = 1;
            const Tensor x_rest = Tensor::FromVector(
                std::vector<float>(xs.begin() + skip * in, xs.end()), {t_count - skip, in});

            Tensor exact, rounded, rest;
            Linear(x, w, &b, &exact);
            ASSERT_TRUE(SetCpuInt8Activations(true));
            Linear(x, w, &b, &rounded);
            Linear(x_rest, w, &b, &rest);
            ASSERT_TRUE(SetCpuInt8Activations(false));
            Tensor exact_again;
            Linear(x, w, &b, &exact_again);
            EXPECT_EQ(OpsTest::Host(exact_again), OpsTest::Host(exact));

            const std::vector<float> got = OpsTest::Host(rounded), base = OpsTest::Host(exact);
            double max_moved = 0;
            for (int64_t t = 0; t < t_count; ++t) {
              // x as the kernel rounds it.
              std::vector<double> xq(in);
              for (int64_t b0 = 0; b0 < in; b0 += 32) {
                float amax = 0;
                for (int64_t k = b0; k < b0 + 32; ++k)
                  amax = std::max(amax, std::fabs(xs[t * in + k]));
                for (int64_t k = b0; k < b0 + 32; ++k) {
                  xq[k] = amax == 0 ? 0
                                    : std::nearbyint(xs[t * in + k] * (127.f / amax)) *
                                          double{amax / 127.f};
                }
              }
              for (int64_t n = 0; n < out_f; ++n) {
                double ref = bias[n], mag = std::fabs(bias[n]);
                for (int64_t k = 0; k < in; ++k) {
                  ref += double{dense[n * in + k]} * xq[k];
                  mag += std::fabs(double{dense[n * in + k]} * xq[k]);
                }
                EXPECT_NEAR(got[t * out_f + n], ref, 2e-6 * mag) << "t " << t << " n " << n;
                max_moved =
                    std::max(max_moved, std::fabs(got[t * out_f + n] - base[t * out_f + n]) / mag);
              }
            }
            EXPECT_GT(max_moved, 0)
                << "the rounded activations changed nothing: was the kernel used?";
            if (bits == 4 && t_count <= 16) {
              if (isa == cpu::Isa::kAvx2) {
                panels_avx2[key] = got;
              } else if (panels_avx2.count(key) != 0) {
                EXPECT_EQ(got, panels_avx2[key]) << "4-bit decode, VNNI against AVX2";
              }
            }
            const std::vector<float> part = OpsTest::Host(rest);
            for (int64_t i = 0; i < (t_count - skip) * out_f; ++i) {
              ASSERT_EQ(part[i], got[skip * out_f + i]) << "rows 1.. alone and inside T, at " << i;
            }
            if (isa == cpu::Isa::kAvx2) {
              // One kernel at every T (CodePanels): two rows alone, decode-sized, give the bits
              // they have inside a T of 3 (token tiles of 2 and 1) or of 40 (the prefill).
              Tensor two;
              ASSERT_TRUE(SetCpuInt8Activations(true));
              Linear(
                  Tensor::FromVector(std::vector<float>(xs.begin(), xs.begin() + 2 * in), {2, in}),
                  w, &b, &two);
              ASSERT_TRUE(SetCpuInt8Activations(false));
              const std::vector<float> alone = OpsTest::Host(two);
              for (int64_t i = 0; i < 2 * out_f; ++i)
                ASSERT_EQ(alone[i], got[i]) << "rows 0-1 alone and inside T, at " << i;
            }
            // A NaN (or inf) in x takes the exact path, which carries it to the outputs, rather
            // than rounding it to some int8 code.
            for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
              std::vector<float> xb = xs;
              xb[in + 5] = bad;
              Tensor with_bad;
              ASSERT_TRUE(SetCpuInt8Activations(true));
              Linear(Tensor::FromVector(xb, {t_count, in}), w, &b, &with_bad);
              ASSERT_TRUE(SetCpuInt8Activations(false));
              const std::vector<float> v = OpsTest::Host(with_bad);
              for (int64_t n = 0; n < out_f; ++n)
                EXPECT_FALSE(std::isfinite(v[out_f + n])) << "n " << n << ", x has " << bad;
            }
          }
  }
  cpu::SetIsaForTesting(cpu::Isa::kAuto);
  EXPECT_GT(isas_run, 0);
}

// The 8-row panel layout is made at load when a kernel will read it (every path on AVX2; with
// AVX-512, 4-bit codes' int8-activation decode), so that the shard sizes its KV cache from the
// memory left after it. Where every path reads the panels (AVX2 without AVX-512, either mode),
// the prepared weight keeps its codes only there and the row-major copy goes.
TEST(CpuPanels, PrepareCpuWeightMakesThePanelsAtLoad) {
  if (!cpu::IsaAvailable(cpu::Isa::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  const int64_t out_f = 16, in = 64;
  std::vector<int32_t> group_of(in);
  for (int64_t k = 0; k < in; ++k) group_of[k] = static_cast<int32_t>(k / 32);
  auto weight = [&](int bits) {
    std::vector<uint8_t> codes(out_f * in, 3);
    return Tensor::Quantized(std::make_shared<const QuantizedWeight>(
        BuildQuantized(bits, out_f, in, codes, group_of, 2, std::vector<float>(out_f * 2, 0.5f),
                       std::vector<float>(out_f * 2, 1.f))));
  };
  const size_t before = CpuDerivedLayoutBytes();
  for (const cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (!cpu::IsaAvailable(isa)) continue;
    cpu::SetIsaForTesting(isa);
    const bool avx2 = isa == cpu::Isa::kAvx2;
    const std::string what = avx2 ? "avx2" : "avx512";
    {
      Tensor w4 = weight(4);
      const Tensor held = w4;  // another holder of the same weight
      const size_t released = CpuReleasedCodeBytes();
      PrepareCpuWeight(&w4);
      EXPECT_EQ(w4.quantized()->cpu_layout.made(), avx2) << what << ", the mode off";
      EXPECT_EQ(w4.quantized()->codes_only_in_panels, avx2) << what;
      EXPECT_FALSE(held.quantized()->codes_only_in_panels) << "the other holder keeps its rows";
      // The codes, and the compact run constants (f16 scale and byte zero; 2 runs per row).
      EXPECT_EQ(CpuReleasedCodeBytes(), released + (avx2 ? out_f * in / 2 + out_f * 2 * 3 : 0))
          << what;
      EXPECT_EQ(w4.quantized()->codes.nbytes(), avx2 ? 0u : out_f * in / 2u) << what;
      Tensor w8_exact = weight(8);
      PrepareCpuWeight(&w8_exact);
      EXPECT_EQ(w8_exact.quantized()->codes_only_in_panels, avx2) << what << ", 8-bit";

      Tensor w4_int8 = weight(4), w8 = weight(8);
      ASSERT_TRUE(SetCpuInt8Activations(true));
      PrepareCpuWeight(&w4_int8);
      PrepareCpuWeight(&w8);
      ASSERT_TRUE(SetCpuInt8Activations(false));
      EXPECT_TRUE(w4_int8.quantized()->cpu_layout.made()) << what << ", the mode on";
      EXPECT_EQ(w4_int8.quantized()->codes_only_in_panels, avx2) << what << ", the mode on";
      // 8-bit codes: the int8 kernels read the panels without VNNI (neither ISA here is
      // the VNNI one), beside the rows where the AVX-512 exact kernels read those.
      EXPECT_TRUE(w8.quantized()->cpu_layout.made()) << what << ", 8-bit, the mode on";
      EXPECT_EQ(w8.quantized()->codes_only_in_panels, avx2) << what << ", 8-bit, the mode on";
      // The start-up log's figure: at least the panels' codes (16 rows x 32 bytes).
      EXPECT_GE(CpuDerivedLayoutBytes(), before + out_f * in / 2) << what;
      // A copy of the weight starts without it.
      const QuantizedWeight copy = *w4_int8.quantized();
      EXPECT_FALSE(copy.cpu_layout.made());
    }
    EXPECT_EQ(CpuDerivedLayoutBytes(), before) << what << ": freed with the weight";
  }
  cpu::SetIsaForTesting(cpu::Isa::kAuto);
}

// A weight whose codes PrepareCpuWeight kept only in the panels gives the bits the weight with
// its rows gives, on every path: decode and prefill (T > 16: f32 rows made from the panels,
// also where a thread's range of rows cuts a panel), exact and with int8 activations (and
// their fallback to the exact path when x has a NaN).
TEST(CpuPanels, WeightKeptOnlyInThePanelsGivesTheSameBits) {
  if (!cpu::IsaAvailable(cpu::Isa::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  cpu::SetIsaForTesting(cpu::Isa::kAvx2);
  const int64_t out_f = 45, in = 1024;
  uint32_t seed = 70;
  struct Case {
    int bits;
    int64_t group;
    bool f16_scales;
  };
  for (const auto& [bits, group, f16_scales] :
       {Case{4, 32, false}, Case{4, 32, true}, Case{4, 128, true}, Case{8, 128, false},
        Case{8, in, false}}) {
    {
      const Tensor rows = Tensor::Quantized(std::make_shared<const QuantizedWeight>(
          RandomQuant(bits, out_f, in, group, false, ++seed, f16_scales).Build()));
      Tensor panels = rows;
      PrepareCpuWeight(&panels);
      ASSERT_TRUE(panels.quantized()->codes_only_in_panels);
      for (const bool int8 : {false, true}) {
        ASSERT_TRUE(SetCpuInt8Activations(int8));
        for (const int64_t t : {1, 3, 16, 17, 40}) {
          std::vector<float> xs = Random(t * in, ++seed);
          if (int8 && t == 3) xs[in + 7] = std::numeric_limits<float>::quiet_NaN();
          const Tensor x = Tensor::FromVector(xs, {t, in});
          Tensor want, got;
          Linear(x, rows, nullptr, &want);
          Linear(x, panels, nullptr, &got);
          const std::string what = std::to_string(bits) + "-bit group " + std::to_string(group) +
                                   (f16_scales ? " f16" : "") + (int8 ? " int8" : " exact") +
                                   " T=" + std::to_string(t);
          for (int64_t i = 0; i < t * out_f; ++i) {
            const float a = want.data<float>()[i], b = got.data<float>()[i];
            ASSERT_TRUE(std::isnan(a) ? std::isnan(b) : a == b) << what << " at " << i;
          }
        }
      }
      ASSERT_TRUE(SetCpuInt8Activations(false));
    }
  }
  cpu::SetIsaForTesting(cpu::Isa::kAuto);
}

TEST(CpuThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int64_t n : {0, 1, 7, 64, 1000, 100003}) {
    for (int64_t grain : {1, 3, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      cpu::ParallelFor(n, grain, [&](int64_t b, int64_t e) {
        ASSERT_LE(0, b);
        ASSERT_LT(b, e);
        ASSERT_LE(e, n);
        for (int64_t i = b; i < e; ++i) hits[i]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << grain << " " << i;
    }
  }
}

TEST(CpuThreadPool, NestedAndConcurrentCallsComplete) {
  std::atomic<int64_t> total{0};
  auto work = [&] {
    cpu::ParallelFor(64, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        // A nested call runs inline on the calling thread.
        cpu::ParallelFor(10, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
      }
    });
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(work);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(total.load(), 4 * 64 * 10);
}

// A container's CPU limit, as cgroup v2's cpu.max and v1's quota and period write it.
TEST(CpuThreadPool, CgroupQuotasCountInCpusRoundedUp) {
  EXPECT_EQ(cpu::CpusOfCgroupMax("max 100000"), 0);  // no limit
  EXPECT_EQ(cpu::CpusOfCgroupMax("-1 100000"), 0);   // v1's "no limit"
  EXPECT_EQ(cpu::CpusOfCgroupMax("200000 100000"), 2);
  EXPECT_EQ(cpu::CpusOfCgroupMax("150000 100000"), 2);  // limits.cpu: 1500m
  EXPECT_EQ(cpu::CpusOfCgroupMax("50000 100000"), 1);
  EXPECT_EQ(cpu::CpusOfCgroupMax("400000 100000\n"), 4);
  for (const char* bad : {"", "max", "100000", "a b", "100000 0", "1 2 3"}) {
    EXPECT_EQ(cpu::CpusOfCgroupMax(bad), 0) << bad;
  }
}

// The pool's default size is what the process may use (affinity and quota), never more than
// the host's CPUs; once the pool exists, its size is fixed.
TEST(CpuThreadPool, SizedToTheCpusTheProcessMayUse) {
  const int available = cpu::CpusAvailable();
  EXPECT_GE(available, 1);
  EXPECT_LE(available, std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_LE(available, CPU_COUNT(&set));
  (void)cpu::ThreadPool::Global();
  EXPECT_FALSE(cpu::SetGlobalPoolSize(1));
}

// The CUDA runtime's current device is per host thread: a thread other than the one that chose
// the shard's GPU (a gRPC worker running a step) must work on that GPU, not on device 0. The
// choice is the process's, once, before any CUDA work: so it runs in a fresh process (a
// re-executed death test). On a one-GPU machine the chosen GPU is device 0 and this shows
// only that nothing breaks.
TEST(CudaDevice, EveryThreadWorksOnTheSelectedGpu) {
#ifdef TGIS_WITH_CUDA
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "CUDA not built/available";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int chosen = cuda::DeviceCount() - 1;
        SelectGpu(chosen);
        int seen = -1;
        std::vector<float> back;
        std::thread worker([&] {
          const Tensor t =
              Tensor::FromVector(std::vector<float>{1, 2, 3}, {3}).ToDevice(Device::kCuda);
          seen = cuda::CurrentDevice();
          const Tensor h = t.ToDevice(Device::kCpu);
          back.assign(h.data<float>(), h.data<float>() + 3);
        });
        worker.join();
        std::fprintf(stderr, "worker on device %d of chosen %d\n", seen, chosen);
        std::exit(seen == chosen && back == std::vector<float>{1, 2, 3} ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "worker on device");
#else
  GTEST_SKIP() << "CUDA not built/available";
#endif
}

// Programmatic dependent launch lets a kernel start while the one before it runs; each kernel
// waits (PriorGridsDone) before it touches what an earlier one wrote, and the decode GEMVs load
// their first weights before that wait. A kernel that read too early would race: a chain of
// decode-shaped layers (residual add and norm, a GEMV, the gated activation, a GEMV, each op
// reading the one before) gives the same bits with it on as off.
TEST(CudaDevice, ProgrammaticLaunchChangesNoResult) {
#ifdef TGIS_WITH_CUDA
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "CUDA not built/available";
  if (!cuda::SetProgrammaticLaunch(true)) {
    GTEST_SKIP() << "this GPU has no programmatic dependent launch (compute capability < 9)";
  }
  const int64_t h = 1024, inter = 2816;
  auto on_gpu = [](const std::vector<float>& v, const Shape& shape) {
    return Tensor::FromVector(v, shape).To(DType::kBF16).ToDevice(Device::kCuda);
  };
  const Tensor norm = on_gpu(Random(h, 301, 0.5f, 1.5f), {h});
  const Tensor gate_up = on_gpu(Random(2 * inter * h, 302, -0.05f, 0.05f), {2 * inter, h});
  const Tensor down = on_gpu(Random(h * inter, 303, -0.05f, 0.05f), {h, inter});
  auto run = [&](bool pdl) {
    cuda::SetProgrammaticLaunch(pdl);
    Tensor residual = on_gpu(Random(h, 304), {1, h});
    Tensor x = on_gpu(Random(h, 305), {1, h});
    for (int layer = 0; layer < 32; ++layer) {
      Tensor normed, gu, act, next;
      AddRmsNorm(&residual, x, norm, 1e-5f, &normed);
      Linear(normed, gate_up, nullptr, &gu);
      GatedActivation(Activation::kSilu, gu, &act);
      Linear(act, down, nullptr, &next);
      x = next;
    }
    std::vector<float> out = OpsTest::Host(x), res = OpsTest::Host(residual);
    out.insert(out.end(), res.begin(), res.end());
    return out;
  };
  const std::vector<float> off = run(false), on = run(true);
  cuda::SetProgrammaticLaunch(true);
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) ASSERT_EQ(on[i], off[i]) << "element " << i;
#else
  GTEST_SKIP() << "CUDA not built/available";
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, OpsTest,
    ::testing::Values(OpsParam{Device::kCpu, DType::kF32}, OpsParam{Device::kCpu, DType::kBF16},
                      OpsParam{Device::kCpu, DType::kF16}, OpsParam{Device::kCuda, DType::kF32},
                      OpsParam{Device::kCuda, DType::kBF16}, OpsParam{Device::kCuda, DType::kF16}),
    ParamName);

}  // namespace
}  // namespace tgis::kernels

namespace tgis::kernels {
namespace {

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Mamba-2's scan (ops.h): a one-channel case in closed form, and a sequence computed in chunks
// (its states carried between calls, as chunked prefill and decode steps do) equal to one
// call, beside another sequence in the same batch whose fresh state is zeroed.
TEST(SelectiveScan, MatchesTheRecurrenceAndCarriesStatesAcrossCalls) {
  {
    // 1 head, head_dim 1, 1 group, N 1, kernel 2: xBC = silu(w0 * prev + w1 * cur + b).
    const SsmConfig cfg{1, 1, 1, 1, 2};
    // proj per token: z | x, B, C | dt (width 1 + 3 + 1).
    const std::vector<float> proj = {0.5f,  1.0f, 2.0f,  -1.0f, 0.3f,
                                     -0.2f, 0.5f, -1.0f, 0.5f,  -0.4f};
    const std::vector<float> w = {0.5f, 1.5f, -1.0f, 0.25f, 2.0f, -0.5f};  // [C 3, K 2]
    const std::vector<float> b = {0.1f, 0.0f, -0.1f};
    Tensor conv_state = Tensor::Zeros({3, 1}, DType::kF32);
    Tensor ssm_state = Tensor::Zeros({1, 1, 1}, DType::kF32);
    Tensor out = Tensor::Zeros({2, 2}, DType::kF32);
    SelectiveScan(cfg, Tensor::FromVector(proj, {2, 5}), Tensor::FromVector(w, {3, 2}),
                  Tensor::FromVector(b, {3}), Tensor::FromVector(std::vector<float>{0.2f}, {1}),
                  Tensor::FromVector(std::vector<float>{0.1f}, {1}),
                  Tensor::FromVector(std::vector<float>{0.7f}, {1}), {0, 2}, {&conv_state},
                  {&ssm_state}, {1}, &out);
    auto silu = [](double v) { return v / (1 + std::exp(-v)); };
    double state = 0, prev[3] = {0, 0, 0};
    const double a = -std::exp(0.1);
    for (int t = 0; t < 2; ++t) {
      double xbc[3];
      for (int c = 0; c < 3; ++c) {
        xbc[c] = silu(w[2 * c] * prev[c] + w[2 * c + 1] * proj[5 * t + 1 + c] + b[c]);
        prev[c] = proj[5 * t + 1 + c];
      }
      const double dt = std::log1p(std::exp(proj[5 * t + 4] + 0.2));
      state = state * std::exp(dt * a) + dt * xbc[1] * xbc[0];
      const double y = state * xbc[2] + 0.7 * xbc[0];
      EXPECT_EQ(out.data<float>()[2 * t], proj[5 * t]);  // z passes through
      EXPECT_NEAR(out.data<float>()[2 * t + 1], y, 1e-6) << "token " << t;
    }
    EXPECT_NEAR(ssm_state.data<float>()[0], state, 1e-6);
  }
  // 4 heads of 3 in 2 groups, N 5, kernel 4; sequence 0 (7 tokens) whole, or in chunks of 3, 1
  // and 3 beside sequence 1 (2 tokens, fresh every call).
  const SsmConfig cfg{4, 3, 2, 5, 4};
  const int64_t inner = 12, channels = inner + 2 * 2 * 5, width = inner + channels + 4;
  const std::vector<float> proj0 = RandomFloats(7 * width, 1, 1.0f);
  const std::vector<float> proj1 = RandomFloats(2 * width, 2, 1.0f);
  const Tensor w = Tensor::FromVector(RandomFloats(channels * 4, 3, 0.5f), {channels, 4});
  const Tensor b = Tensor::FromVector(RandomFloats(channels, 4, 0.1f), {channels});
  const Tensor dtb = Tensor::FromVector(RandomFloats(4, 5, 0.5f), {4});
  const Tensor alog = Tensor::FromVector(RandomFloats(4, 6, 0.5f), {4});
  const Tensor dd = Tensor::FromVector(RandomFloats(4, 7, 1.0f), {4});
  auto run = [&](const std::vector<int>& chunks) {
    Tensor conv[2] = {Tensor::Zeros({channels, 3}, DType::kF32),
                      Tensor::Zeros({channels, 3}, DType::kF32)};
    Tensor ssm[2] = {Tensor::Zeros({4, 3, 5}, DType::kF32), Tensor::Zeros({4, 3, 5}, DType::kF32)};
    std::vector<float> ys;
    int done = 0;
    for (int n : chunks) {
      std::vector<float> rows(proj0.begin() + done * width, proj0.begin() + (done + n) * width);
      rows.insert(rows.end(), proj1.begin(), proj1.end());
      Tensor out = Tensor::Zeros({n + 2, 2 * inner}, DType::kF32);
      SelectiveScan(cfg, Tensor::FromVector(rows, {n + 2, width}), w, b, dtb, alog, dd,
                    {0, n, n + 2}, {&conv[0], &conv[1]}, {&ssm[0], &ssm[1]},
                    {static_cast<uint8_t>(done == 0), 1}, &out);
      ys.insert(ys.end(), out.data<float>(), out.data<float>() + n * 2 * inner);
      done += n;
    }
    return ys;
  };
  const std::vector<float> whole = run({7});
  EXPECT_EQ(run({3, 1, 3}), whole);
  EXPECT_EQ(run({1, 1, 1, 1, 1, 1, 1}), whole);
}

}  // namespace
}  // namespace tgis::kernels

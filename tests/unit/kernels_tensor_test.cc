// Tensor and the bf16 / f16 conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_STREQ(DTypeName(DType::kF32), "f32");
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_STREQ(DTypeName(DType::kF16), "f16");
  EXPECT_STREQ(DTypeName(DType::kI32), "i32");
  EXPECT_STREQ(DTypeName(DType::kI64), "i64");
  EXPECT_STREQ(DTypeName(DType::kI8), "i8");
  EXPECT_STREQ(DTypeName(DType::kU8), "u8");
  // u8 values stay themselves (bitsandbytes' weight_format 0-3; 255 must not read as -1).
  const std::vector<uint8_t> u = {0, 3, 200, 255};
  const Tensor t = Tensor::FromHost(u.data(), {4}, DType::kU8).To(DType::kI64);
  EXPECT_EQ(t.data<int64_t>()[2], 200);
  EXPECT_EQ(t.data<int64_t>()[3], 255);
}

TEST(Bf16, KnownValues) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(F32ToBf16(-0.0f), 0x8000);
  // Round to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even).
  EXPECT_EQ(F32ToBf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 -> 1 + 2^-6.
  EXPECT_EQ(F32ToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808001)), 0x3f81);
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(F32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest float rounds up to infinity (as torch does).
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);
  // NaN stays NaN (also one whose payload lives only in the low 16 bits).
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(FromBits(0x7f800001)))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(FromBits(0xff800001)))));
  // Subnormals round like everything else.
  EXPECT_EQ(F32ToBf16(FromBits(0x00018000)), 0x0002);  // tie, 1 is odd -> 2
  EXPECT_EQ(F32ToBf16(FromBits(0x00008000)), 0x0000);  // tie, 0 is even -> 0
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0x0001), FromBits(0x00010000));
}

TEST(Bf16, RoundTripAllPatterns) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    EXPECT_EQ(Bits(f), h << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(f))));
    } else {
      ASSERT_EQ(F32ToBf16(f), h) << std::hex << h;
    }
  }
}

TEST(Bf16, MatchesNearestEvenReference) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> dist;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = dist(rng);
    const float f = FromBits(u);
    if (std::isnan(f)) continue;
    // Reference: the two bf16 neighbours (truncation and the next magnitude up; above the
    // largest finite value that is inf, which counts as 2^128 for rounding), in double.
    const uint16_t lo = static_cast<uint16_t>(u >> 16);
    if ((lo & 0x7f80) == 0x7f80) continue;  // inf inputs are covered elsewhere
    const double a = Bf16ToF32(lo);
    const double b = (lo & 0x7fff) == 0x7f7f ? std::copysign(0x1p128, a)
                                             : Bf16ToF32(static_cast<uint16_t>(lo + 1));
    const double da = std::fabs(f - a);
    const double db = std::fabs(b - f);
    const uint16_t want =
        (da < db || (da == db && (lo & 1) == 0)) ? lo : static_cast<uint16_t>(lo + 1);
    ASSERT_EQ(F32ToBf16(f), want) << std::hex << u;
  }
}

TEST(F16, KnownValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(0.0f), 0x0000);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);  // below the halfway point to 65536
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // halfway: ties to even = inf
  EXPECT_EQ(F32ToF16(1e10f), 0x7c00);
  EXPECT_EQ(F32ToF16(-1e10f), 0xfc00);
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(F32ToF16(0x1p-14f), 0x0400);         // smallest normal
  EXPECT_EQ(F32ToF16(0x1p-24f), 0x0001);         // smallest subnormal
  EXPECT_EQ(F32ToF16(0x1p-25f), 0x0000);         // halfway to it: ties to even = 0
  EXPECT_EQ(F32ToF16(1.5f * 0x1p-25f), 0x0001);  // above halfway
  EXPECT_EQ(F32ToF16(3 * 0x1p-25f), 0x0002);     // 1.5 ulps: tie, 1 is odd -> 2
  EXPECT_EQ(F32ToF16(0x1p-30f), 0x0000);
  EXPECT_EQ(F32ToF16(1.0f / 3), 0x3555);
  EXPECT_EQ(F32ToF16(1.0f + 0x1p-11f), 0x3c00);      // tie -> even
  EXPECT_EQ(F32ToF16(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie -> even
  EXPECT_EQ(F32ToF16(0x1p-14f - 0x1p-25f), 0x0400);  // rounds up into the normal range
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(FromBits(0x7f800001)))));
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0x0001), 0x1p-24f);
  EXPECT_EQ(F16ToF32(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(F16ToF32(0x8001), -0x1p-24f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(F16ToF32(0x7c00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
}

TEST(F16, RoundTripAllPatterns) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f))));
      EXPECT_EQ((h & 0x7c00), 0x7c00u);
    } else {
      ASSERT_EQ(F32ToF16(f), h) << std::hex << h;
    }
  }
}

// Every float in (and just beyond) the half range must round to the nearest half, ties to
// even. The reference: the two neighbouring halves, compared in double.
TEST(F16, MatchesNearestEvenReference) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<double> exp_dist(-27, 16.5);
  std::uniform_real_distribution<double> m(1, 2);
  for (int i = 0; i < 200000; ++i) {
    float f = static_cast<float>(m(rng) * std::exp2(std::floor(exp_dist(rng))));
    if (i % 2) f = -f;
    const uint16_t got = F32ToF16(f);
    const double g = F16ToF32(got);
    if (std::isinf(g)) {
      ASSERT_GE(std::fabs(f), 65520.0) << f;
      continue;
    }
    // Neighbours of `got` in magnitude.
    const uint16_t mag = got & 0x7fff;
    const double up = mag == 0x7bff ? 65536.0 : F16ToF32(static_cast<uint16_t>(mag + 1));
    const double down = mag == 0 ? -F16ToF32(1) : F16ToF32(static_cast<uint16_t>(mag - 1));
    const double af = std::fabs(static_cast<double>(f));
    const double ag = std::fabs(g);
    ASSERT_LE(std::fabs(af - ag), std::fabs(af - up)) << f;
    ASSERT_LE(std::fabs(af - ag), std::fabs(af - down)) << f;
    if (std::fabs(af - ag) == std::fabs(af - up) || std::fabs(af - ag) == std::fabs(af - down)) {
      ASSERT_EQ(mag & 1, 0) << "tie must go to even: " << f;
    }
  }
}

TEST(Tensor, EmptyZerosAlignment) {
  Tensor u;
  EXPECT_FALSE(u.defined());
  Tensor t = Tensor::Empty({3, 5}, DType::kF32);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.rank(), 2);
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.nbytes(), 60u);
  EXPECT_EQ(t.dim(-1), 5);
  EXPECT_EQ(t.dim(0), 3);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_EQ(t.device(), Device::kCpu);
  Tensor z = Tensor::Zeros({7}, DType::kBF16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(z.raw()) % 64, 0u);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(z.data<uint16_t>()[i], 0);
  Tensor e = Tensor::Empty({0, 4}, DType::kF32);
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.numel(), 0);
}

TEST(Tensor, FromVectorRowsReshapeShareStorage) {
  std::vector<float> v(12);
  for (int i = 0; i < 12; ++i) v[i] = static_cast<float>(i);
  Tensor t = Tensor::FromVector(v, {4, 3});
  EXPECT_EQ(t.dtype(), DType::kF32);
  EXPECT_EQ(t.data<float>()[7], 7.0f);
  EXPECT_NE(t.data<float>(), v.data());  // a copy

  Tensor rows = t.Rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.data<float>()[0], 3.0f);
  rows.data<float>()[0] = 100.0f;
  EXPECT_EQ(t.data<float>()[3], 100.0f);
  EXPECT_EQ(t.Rows(4, 4).numel(), 0);

  Tensor r = t.Reshape({2, 2, 3});
  EXPECT_EQ(r.raw(), t.raw());
  EXPECT_EQ(r.shape(), (Shape{2, 2, 3}));
  EXPECT_EQ(t.Reshape({-1, 6}).shape(), (Shape{2, 6}));
  EXPECT_EQ(t.Reshape({12}).shape(), (Shape{12}));

  Tensor ints = Tensor::FromVector(std::vector<int32_t>{1, 2, 3}, {3});
  EXPECT_EQ(ints.dtype(), DType::kI32);
  Tensor longs = Tensor::FromVector(std::vector<int64_t>{1, 2}, {2});
  EXPECT_EQ(longs.dtype(), DType::kI64);
  EXPECT_EQ(longs.data<int64_t>()[1], 2);
}

TEST(Tensor, RowsOutlivesTheOriginal) {
  Tensor rows;
  {
    Tensor t = Tensor::FromVector(std::vector<float>{1, 2, 3, 4}, {2, 2});
    rows = t.Rows(1, 2);
  }
  EXPECT_EQ(rows.data<float>()[0], 3.0f);
  EXPECT_EQ(rows.data<float>()[1], 4.0f);
}

TEST(Tensor, ViewKeepsItsOwnerAlive) {
  auto buf = std::make_shared<std::vector<float>>(std::vector<float>{1, 2, 3, 4, 5, 6});
  std::weak_ptr<std::vector<float>> weak = buf;
  Tensor v = Tensor::View(buf->data(), {2, 3}, DType::kF32, Device::kCpu, buf);
  buf.reset();
  EXPECT_FALSE(weak.expired());
  EXPECT_EQ(v.data<float>()[5], 6.0f);
  Tensor r = v.Rows(1, 2);
  v = Tensor();
  EXPECT_FALSE(weak.expired());
  EXPECT_EQ(r.data<float>()[0], 4.0f);
  r = Tensor();
  EXPECT_TRUE(weak.expired());
}

TEST(Tensor, ToConvertsBetweenDTypes) {
  const std::vector<float> v = {1.0f, -2.5f, 3.14159265f, 65504.0f, 1e-8f, -0.0f};
  Tensor t = Tensor::FromVector(v, {2, 3});
  Tensor b = t.To(DType::kBF16);
  EXPECT_EQ(b.dtype(), DType::kBF16);
  EXPECT_EQ(b.shape(), t.shape());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.data<uint16_t>()[i], F32ToBf16(v[i]));
  Tensor h = t.To(DType::kF16);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(h.data<uint16_t>()[i], F32ToF16(v[i]));
  Tensor back = b.To(DType::kF32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back.data<float>()[i], Bf16ToF32(F32ToBf16(v[i])));
  Tensor hb = h.To(DType::kBF16);  // f16 -> bf16 goes through f32
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(hb.data<uint16_t>()[i], F32ToBf16(F16ToF32(F32ToF16(v[i]))));
  Tensor same = t.To(DType::kF32);
  EXPECT_NE(same.raw(), t.raw());
  EXPECT_EQ(same.data<float>()[2], v[2]);

  Tensor ints = Tensor::FromVector(std::vector<int32_t>{-3, 0, 7}, {3});
  Tensor as_f = ints.To(DType::kF32);
  EXPECT_EQ(as_f.data<float>()[0], -3.0f);
  Tensor as_l = ints.To(DType::kI64);
  EXPECT_EQ(as_l.data<int64_t>()[2], 7);
  Tensor trunc = Tensor::FromVector(std::vector<float>{2.7f, -2.7f}, {2}).To(DType::kI32);
  EXPECT_EQ(trunc.data<int32_t>()[0], 2);
  EXPECT_EQ(trunc.data<int32_t>()[1], -2);
}

// Large tensors convert in chunks over the threads: every element, the ragged last chunk
// included, as the scalar converters give it.
TEST(Tensor, ToConvertsLargeTensorsElementByElementAlike) {
  const int64_t n = 3 * (int64_t{1} << 16) + 5;
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = std::ldexp(static_cast<float>(i % 977) - 488.3f, i % 41 - 20);
  // Values whose rounding the vector paths must get as the scalar converters do: NaNs (quiet,
  // signalling, either sign), infinities, the largest float (rounds to inf in bf16), ties to
  // even both ways, subnormals, -0; in the middle of a vector and in the ragged tail.
  const uint32_t special[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff800000u, 0x7f800000u,
                              0x7f7fffffu, 0x3f808000u, 0x3f818000u, 0xbf808000u, 0x00000001u,
                              0x807fffffu, 0x80000000u, 0x3f80ffffu};
  for (int64_t j = 0; j < 13; ++j) {
    for (int64_t at : {j + 3, n - 1 - j}) std::memcpy(&v[at], &special[j], 4);
  }
  const Tensor t = Tensor::FromVector(v, {n});
  const Tensor b = t.To(DType::kBF16), h = t.To(DType::kF16);
  const Tensor bf = b.To(DType::kF32), hf = h.To(DType::kF32), hb = h.To(DType::kBF16);
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(b.data<uint16_t>()[i], F32ToBf16(v[i])) << i;
    ASSERT_EQ(h.data<uint16_t>()[i], F32ToF16(v[i])) << i;
    ASSERT_EQ(bits(bf.data<float>()[i]), bits(Bf16ToF32(F32ToBf16(v[i])))) << i;
    ASSERT_EQ(bits(hf.data<float>()[i]), bits(F16ToF32(F32ToF16(v[i])))) << i;
    ASSERT_EQ(hb.data<uint16_t>()[i], F32ToBf16(F16ToF32(F32ToF16(v[i])))) << i;
  }
}

TEST(Tensor, ToDeviceCpuCopies) {
  Tensor t = Tensor::FromVector(std::vector<float>{1, 2}, {2});
  Tensor c = t.ToDevice(Device::kCpu);
  EXPECT_NE(c.raw(), t.raw());
  EXPECT_EQ(c.data<float>()[1], 2.0f);
}

TEST(Tensor, DebugString) {
  Tensor t = Tensor::FromVector(std::vector<float>{1.5f, 2}, {1, 2});
  const std::string s = t.DebugString();
  EXPECT_NE(s.find("f32"), std::string::npos) << s;
  EXPECT_NE(s.find("cpu"), std::string::npos) << s;
  EXPECT_NE(s.find("[1, 2]"), std::string::npos) << s;
  EXPECT_NE(s.find("1.5"), std::string::npos) << s;
  EXPECT_EQ(Tensor().DebugString(), "Tensor(undefined)");
}

using TensorDeathTest = ::testing::Test;

TEST_F(TensorDeathTest, BadReshapeAndRowsAbort) {
  Tensor t = Tensor::Zeros({2, 3}, DType::kF32);
  EXPECT_DEATH(t.Reshape({4, 2}), "element counts differ");
  EXPECT_DEATH(t.Rows(1, 3), "Rows");
}

#ifndef TGIS_WITH_CUDA
TEST_F(TensorDeathTest, CudaTensorsAbortWithoutCuda) {
  EXPECT_DEATH(Tensor::Empty({2}, DType::kF32, Device::kCuda), "no CUDA");
  static float dummy[4];
  Tensor x = Tensor::View(dummy, {1, 4}, DType::kF32, Device::kCuda, nullptr);
  Tensor w = Tensor::View(dummy, {1, 4}, DType::kF32, Device::kCuda, nullptr);
  Tensor out;
  EXPECT_DEATH(Linear(x, w, nullptr, &out),
               "Linear: got a CUDA tensor, but this build has no CUDA");
}
#endif

}  // namespace
}  // namespace tgis::kernels

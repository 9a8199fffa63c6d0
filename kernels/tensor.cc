#include "kernels/tensor.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "kernels/check.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda_ops.h"
#include "kernels/quantized.h"

namespace tgis::kernels {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kI8:
    case DType::kU8:
    case DType::kF8E4M3:
      return 1;
  }
  TGIS_FATAL("unknown dtype %d", static_cast<int>(t));
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kI8:
      return "i8";
    case DType::kU8:
      return "u8";
    case DType::kF8E4M3:
      return "f8e4m3";
  }
  return "?";
}

bool WeightDTypeFromName(const std::string& name, DType* out) {
  if (name == "float32" || name == "float") {
    *out = DType::kF32;
  } else if (name == "bfloat16") {
    *out = DType::kBF16;
  } else if (name == "float16" || name == "half") {
    *out = DType::kF16;
  } else {
    return false;
  }
  return true;
}

// ---- bf16 / f16 ----------------------------------------------------------------------------

namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

float Fp8E4M3ToF32(uint8_t v) {
  if ((v & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits =
      (static_cast<uint32_t>(v & 0x7F) << 20) | (static_cast<uint32_t>(v & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * 0x1p120f;
}

float F16ToF32(uint16_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  const uint32_t exp = (v >> 10) & 0x1fu;
  uint32_t mant = v & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);  // +-0
    // Subnormal: mant * 2^-24, exact in f32.
    float f = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -f : f;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t F32ToF16(float v) {
  const uint32_t u = FloatBits(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  if (abs >= 0x477ff000u) {  // >= 65520 rounds to inf (65504 is the largest finite half)
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
    // Value = abs_f * 2^24 half-ulps; round to nearest even in integer arithmetic.
    if (abs < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself ties to 0)
    const uint32_t e = abs >> 23;        // biased f32 exponent, 102..112
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // m * 2^(e-127-23) / 2^-24 = m >> (126 - e)
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);  // q may reach 0x400: the smallest normal, correct
  }
  // Normal: rebias the exponent (127 -> 15), round the 13 dropped mantissa bits to nearest even.
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may reach inf: correct
  return static_cast<uint16_t>(sign | h);
}

// ---- Tensor -------------------------------------------------------------------------------

namespace {

constexpr size_t kAlign = 64;

int64_t NumelOf(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    TGIS_CHECK(d >= 0, "negative dimension %lld", static_cast<long long>(d));
    n *= d;
  }
  return n;
}

std::shared_ptr<void> Allocate(size_t nbytes, Device device, void** data) {
  if (device == Device::kCuda) {
#ifdef TGIS_WITH_CUDA
    void* p = cuda::Malloc(nbytes);
    *data = p;
    return std::shared_ptr<void>(p, [](void* q) { cuda::Free(q); });
#else
    TGIS_FATAL("a CUDA tensor was requested but this build has no CUDA");
#endif
  }
  size_t size = (nbytes + kAlign - 1) / kAlign * kAlign;
  if (size == 0) size = kAlign;
  void* p = std::aligned_alloc(kAlign, size);
  TGIS_CHECK(p != nullptr, "out of memory allocating %zu bytes", size);
  *data = p;
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

double LoadAsDouble(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(p)[i];
    case DType::kI64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::kI8:
      return static_cast<const int8_t*>(p)[i];
    case DType::kU8:
      return static_cast<const uint8_t*>(p)[i];
    case DType::kF8E4M3:
      return Fp8E4M3ToF32(static_cast<const uint8_t*>(p)[i]);
  }
  return 0;
}

bool IsFloatType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF8E4M3;
}

#if defined(__x86_64__)
// F32ToBf16 over [begin, end), 16 lanes at a time (bf16 to f32: cpu::Bf16ToF32Row): the same
// bits (NaNs quieted, the rest rounded to nearest even), where the scalar loops were a seventh of a
// bitsandbytes start (f32 files served as bf16, the linears widened back to quantize).

// Eight F32ToBf16 results as the low halves of int32 lanes.
__attribute__((target("avx2"), always_inline)) inline __m256i Bf16Of8(const float* p) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i quieted = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quieted, nan), 16);
}

__attribute__((target("avx2"))) void F32ToBf16Avx2(const float* src, uint16_t* dst, int64_t begin,
                                                   int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    // packus interleaves 128-bit lanes; quadwords 0 2 1 3 put them back in order.
    const __m256i both = _mm256_packus_epi32(Bf16Of8(src + i), Bf16Of8(src + i + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permute4x64_epi64(both, 0xD8));
  }
  for (; i < end; ++i) dst[i] = F32ToBf16(src[i]);
}

#endif

// n elements of float type `from` into `to` (f32, bf16 or f16), in chunks over the CPU threads:
// checkpoints convert at load (f32 files served in bf16, f16 ones in f32), where one thread
// converting element by element through double read about 200 MiB/s. One loop per pair of
// types, so that each has one load and one store the compiler can see through.
void ConvertFloats(const void* src, DType from, void* dst, DType to, int64_t n) {
  constexpr int64_t kChunk = int64_t{1} << 16;
#if defined(__x86_64__)
  const bool to_bf16 = from == DType::kF32 && to == DType::kBF16;
  if ((to_bf16 || (from == DType::kBF16 && to == DType::kF32)) && cpu::UseAvx2Kernels()) {
    cpu::ParallelFor((n + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
      const int64_t begin = first * kChunk, end = std::min(n, last * kChunk);
      to_bf16
          ? F32ToBf16Avx2(static_cast<const float*>(src), static_cast<uint16_t*>(dst), begin, end)
          : cpu::Bf16ToF32Row(static_cast<const uint16_t*>(src) + begin, end - begin,
                              static_cast<float*>(dst) + begin);
    });
    return;
  }
#endif
  auto run = [&](auto load, auto store) {
    cpu::ParallelFor((n + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
      const int64_t end = std::min(n, last * kChunk);
      for (int64_t i = first * kChunk; i < end; ++i) store(i, load(i));
    });
  };
  auto with_store = [&](auto load) {
    if (to == DType::kF32) {
      run(load, [&](int64_t i, float v) { static_cast<float*>(dst)[i] = v; });
    } else if (to == DType::kBF16) {
      run(load, [&](int64_t i, float v) { static_cast<uint16_t*>(dst)[i] = F32ToBf16(v); });
    } else {
      run(load, [&](int64_t i, float v) { static_cast<uint16_t*>(dst)[i] = F32ToF16(v); });
    }
  };
  // Every float type widens to f32 exactly.
  const auto* u16 = static_cast<const uint16_t*>(src);
  switch (from) {
    case DType::kBF16:
      return with_store([&](int64_t i) { return Bf16ToF32(u16[i]); });
    case DType::kF16:
      return with_store([&](int64_t i) { return F16ToF32(u16[i]); });
    case DType::kF8E4M3:
      return with_store(
          [&](int64_t i) { return Fp8E4M3ToF32(static_cast<const uint8_t*>(src)[i]); });
    default:
      return with_store([&](int64_t i) { return static_cast<const float*>(src)[i]; });
  }
}

}  // namespace

int64_t Tensor::numel() const { return defined() ? NumelOf(shape_) : 0; }

Tensor Tensor::Empty(const Shape& shape, DType dtype, Device device) {
  TGIS_CHECK(!shape.empty(), "a tensor needs at least one dimension");
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  t.owner_ = Allocate(static_cast<size_t>(NumelOf(shape)) * DTypeSize(dtype), device, &t.data_);
  return t;
}

Tensor Tensor::Zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = Empty(shape, dtype, device);
  if (device == Device::kCuda) {
#ifdef TGIS_WITH_CUDA
    cuda::Memset(t.data_, 0, t.nbytes());
#endif
  } else {
    std::memset(t.data_, 0, t.nbytes());
  }
  return t;
}

Tensor Tensor::FromHost(const void* data, const Shape& shape, DType dtype) {
  Tensor t = Empty(shape, dtype, Device::kCpu);
  if (t.nbytes()) std::memcpy(t.data_, data, t.nbytes());
  return t;
}

Tensor Tensor::View(void* data, const Shape& shape, DType dtype, Device device,
                    std::shared_ptr<void> keepalive) {
  TGIS_CHECK(!shape.empty(), "a tensor needs at least one dimension");
  NumelOf(shape);  // validates
  Tensor t;
  t.owner_ = std::move(keepalive);
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::Quantized(std::shared_ptr<const QuantizedWeight> q) {
  TGIS_CHECK(q != nullptr, "Tensor::Quantized of nothing");
  Tensor t;
  t.shape_ = {q->out, q->in};
  t.dtype_ = DType::kI8;
  t.device_ = q->codes.device();
  t.quant_ = std::move(q);
  return t;
}

Tensor Tensor::Rows(int64_t begin, int64_t end) const {
  TGIS_CHECK(defined(), "Rows of an undefined tensor");
  TGIS_CHECK(!quant_, "Rows of a quantized weight");
  TGIS_CHECK(0 <= begin && begin <= end && end <= shape_[0], "Rows [%lld, %lld) out of %s",
             static_cast<long long>(begin), static_cast<long long>(end),
             ShapeString(shape_).c_str());
  Tensor t = *this;
  const int64_t row = shape_[0] == 0 ? 0 : numel() / shape_[0];
  t.data_ = static_cast<char*>(data_) + begin * row * static_cast<int64_t>(DTypeSize(dtype_));
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::Reshape(const Shape& shape) const {
  TGIS_CHECK(defined(), "Reshape of an undefined tensor");
  TGIS_CHECK(!quant_, "Reshape of a quantized weight");
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      TGIS_CHECK(infer < 0, "Reshape: more than one -1 in %s", ShapeString(shape).c_str());
      infer = static_cast<int>(i);
    } else {
      TGIS_CHECK(s[i] >= 0, "Reshape: bad shape %s", ShapeString(shape).c_str());
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TGIS_CHECK(known > 0 && numel() % known == 0, "Reshape %s -> %s", ShapeString(shape_).c_str(),
               ShapeString(shape).c_str());
    s[infer] = numel() / known;
    known *= s[infer];
  }
  TGIS_CHECK(!s.empty() && known == numel(), "Reshape %s -> %s: element counts differ",
             ShapeString(shape_).c_str(), ShapeString(shape).c_str());
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::To(DType dtype) const {
  TGIS_CHECK(defined(), "To of an undefined tensor");
  TGIS_CHECK(device_ == Device::kCpu, "Tensor::To(dtype) runs on the CPU only");
  TGIS_CHECK(!quant_, "Tensor::To(dtype) of a quantized weight (Dequantize it)");
  Tensor out = Empty(shape_, dtype, device_);
  const int64_t n = numel();
  if (dtype == dtype_) {
    if (n) std::memcpy(out.data_, data_, nbytes());
    return out;
  }
  if (IsFloatType(dtype_) && IsFloatType(dtype) && dtype != DType::kF8E4M3) {
    ConvertFloats(data_, dtype_, out.data_, dtype, n);
    return out;
  }
  // Everything else goes through double: exact for every float <-> float widening and for ints
  // up to 2^53; float -> int truncates toward zero (as a C cast / torch .to(int) does).
  for (int64_t i = 0; i < n; ++i) {
    const double v = LoadAsDouble(data_, dtype_, i);
    switch (dtype) {
      case DType::kF32:
        out.data<float>()[i] = static_cast<float>(v);
        break;
      case DType::kBF16:
        out.data<uint16_t>()[i] = F32ToBf16(static_cast<float>(v));
        break;
      case DType::kF16:
        out.data<uint16_t>()[i] = F32ToF16(static_cast<float>(v));
        break;
      case DType::kI32:
        out.data<int32_t>()[i] = static_cast<int32_t>(v);
        break;
      case DType::kI64:
        out.data<int64_t>()[i] =
            dtype_ == DType::kI64 ? data<int64_t>()[i] : static_cast<int64_t>(v);
        break;
      case DType::kI8:
        out.data<int8_t>()[i] = static_cast<int8_t>(v);
        break;
      case DType::kU8:
        out.data<uint8_t>()[i] = static_cast<uint8_t>(v);
        break;
      case DType::kF8E4M3:
        TGIS_FATAL("To(f8e4m3): nothing converts to float8 (checkpoints are read, not written)");
    }
  }
  return out;
}

Tensor Tensor::ToDevice(Device device) const {
  TGIS_CHECK(defined(), "ToDevice of an undefined tensor");
  if (quant_) {
    return Quantized(std::make_shared<const QuantizedWeight>(QuantizedToDevice(*quant_, device)));
  }
  if (device_ == Device::kCpu && device == Device::kCpu) return To(dtype_);
#ifdef TGIS_WITH_CUDA
  Tensor out = Empty(shape_, dtype_, device);
  cuda::Copy(out.data_, device, data_, device_, nbytes());
  return out;
#else
  TGIS_FATAL("Tensor::ToDevice: CUDA tensors need a build with CUDA");
#endif
}

std::string Tensor::DebugString() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "Tensor(" << DTypeName(dtype_) << ", " << (device_ == Device::kCpu ? "cpu" : "cuda") << ", "
     << ShapeString(shape_) << ")";
  if (quant_) return os.str() + " quantized";
  if (device_ == Device::kCpu) {
    const int64_t n = numel();
    const int64_t show = n < 8 ? n : 8;
    os << " {";
    for (int64_t i = 0; i < show; ++i) {
      if (i) os << ", ";
      os << LoadAsDouble(data_, dtype_, i);
    }
    if (show < n) os << ", ...";
    os << "}";
  }
  return os.str();
}

int GpuCount() {
#ifdef TGIS_WITH_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

void SelectGpu(int index) {
#ifdef TGIS_WITH_CUDA
  cuda::SetDevice(index);
#else
  TGIS_FATAL("SelectGpu(%d): this build has no CUDA", index);
#endif
}

bool SetGpuProgrammaticLaunch(bool on) {
#ifdef TGIS_WITH_CUDA
  return GpuCount() > 0 && cuda::SetProgrammaticLaunch(on);
#else
  (void)on;
  return false;
#endif
}

bool SetGpuTensorCoreGemv(bool on) {
#ifdef TGIS_WITH_CUDA
  cuda::SetTensorCoreGemv(on);
  return on && GpuCount() > 0;
#else
  (void)on;
  return false;
#endif
}

}  // namespace tgis::kernels

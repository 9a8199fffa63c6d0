// Tensor: a device, a dtype, a shape and contiguous storage (owned, or a view of memory kept
// alive by someone else, such as mmap'd safetensors). Kernels take and return these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace tgis::kernels {

enum class Device { kCpu, kCuda };
// kF8E4M3: float8 e4m3fn bytes as fp8 checkpoints store them; only read (converted to f32
// exactly) and held by quantized weights, never computed in.
enum class DType { kF32, kBF16, kF16, kI32, kI64, kI8, kU8, kF8E4M3 };

size_t DTypeSize(DType t);
const char* DTypeName(DType t);
// A weights dtype as TGIS's --dtype names it: float32 (float), bfloat16, float16 (half).
// False for any other name.
bool WeightDTypeFromName(const std::string& name, DType* out);

using Shape = std::vector<int64_t>;

struct QuantizedWeight;  // kernels/quantized.h

class Tensor {
 public:
  Tensor() = default;
  // Uninitialized / zero-filled storage of the given shape.
  static Tensor Empty(const Shape& shape, DType dtype, Device device = Device::kCpu);
  static Tensor Zeros(const Shape& shape, DType dtype, Device device = Device::kCpu);
  // A copy of host data.
  static Tensor FromHost(const void* data, const Shape& shape, DType dtype);
  template <typename T>
  static Tensor FromVector(const std::vector<T>& v, const Shape& shape);
  // A view of external memory; `keepalive` owns it.
  static Tensor View(void* data, const Shape& shape, DType dtype, Device device,
                     std::shared_ptr<void> keepalive);
  // A linear weight stored quantized: it has the dense weight's shape [out, in] and no data of
  // its own (raw() is null); only Linear, ToDevice and quantized() read it.
  static Tensor Quantized(std::shared_ptr<const QuantizedWeight> q);
  const QuantizedWeight* quantized() const { return quant_.get(); }

  bool defined() const { return !shape_.empty(); }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

  // Rows [begin, end) along dimension 0, sharing storage.
  Tensor Rows(int64_t begin, int64_t end) const;
  // Same storage, another shape with the same number of elements (one dim may be -1).
  Tensor Reshape(const Shape& shape) const;
  // A contiguous copy converted to `dtype` (CPU).
  Tensor To(DType dtype) const;
  // A copy on `device` (same dtype). CPU -> CPU copies; anything with CUDA needs a CUDA build.
  Tensor ToDevice(Device device) const;
  std::string DebugString() const;

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  std::shared_ptr<const QuantizedWeight> quant_;
};

// GPUs this process can use: 0 in a build without CUDA or on a machine without a GPU.
int GpuCount();
// Makes GPU `index` this process's device (call before any CUDA tensor exists).
void SelectGpu(int index);
// Whether CUDA kernels may start while the kernel before them finishes (programmatic dependent
// launch; on by default on GPUs of compute capability 9 and later). Benchmarks turn it off to
// measure what it gives. Returns whether it is now in effect: false without such a GPU.
bool SetGpuProgrammaticLaunch(bool on);
// Whether decode GEMVs of 16-bit weights (up to 8 rows) and of 4-bit GPTQ/AWQ codes in groups
// of 128 or per channel (up to 16 rows) run on tensor cores rather than CUDA cores (off by
// default until timed on a GPU; benchmarks compare the two). Returns whether it is now in effect.
bool SetGpuTensorCoreGemv(bool on);

// bf16 / f16 <-> f32 conversions on the host.
// (The bf16 ones are inline: checkpoints convert through them at load.)
inline float Bf16ToF32(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint16_t F32ToBf16(float v) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, make sure it stays a (quiet) NaN
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even; a carry into the exponent correctly rounds up to the next binade / inf.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float F16ToF32(uint16_t v);
uint16_t F32ToF16(float v);
// float8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities; 0x7F and
// 0xFF are NaN) to f32, exactly. Its magnitude bits placed at f32's exponent and mantissa
// top and scaled by 2^120 give normals and subnormals alike; the kernels do the same.
float Fp8E4M3ToF32(uint8_t v);

template <typename T>
Tensor Tensor::FromVector(const std::vector<T>& v, const Shape& shape) {
  DType t;
  if constexpr (std::is_same_v<T, float>) {
    t = DType::kF32;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    t = DType::kI32;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    t = DType::kI64;
  } else {
    static_assert(sizeof(T) == 0, "unsupported element type");
  }
  return FromHost(v.data(), shape, t);
}

}  // namespace tgis::kernels

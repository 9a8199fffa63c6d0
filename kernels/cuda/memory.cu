// Device memory, copies and the process's stream. Allocations come from the stream-ordered
// pool (cudaMallocAsync), which keeps freed memory for reuse: a forward pass allocates and
// frees its activations every step, and cudaMalloc/cudaFree would synchronize the device
// each time.
#include <atomic>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

namespace {

std::atomic<int> g_device{-1};   // the GPU SetDevice chose; -1: none chosen (the runtime's 0)
thread_local int t_device = -1;  // the GPU this thread is bound to
std::atomic<bool> g_programmatic_off{false};  // SetProgrammaticLaunch(false)

}  // namespace

void BindThread() {
  const int device = g_device.load(std::memory_order_relaxed);
  if (device >= 0 && t_device != device) {
    TGIS_CUDA_CHECK(cudaSetDevice(device));
    t_device = device;
  }
}

cudaStream_t Stream() {
  BindThread();  // every launch, copy and GEMM asks for the stream first
  static cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    TGIS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Keep what the pool holds instead of returning it to the driver at each synchronization.
    int device = 0;
    TGIS_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    TGIS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    TGIS_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return s;
  }();
  return stream;
}

bool ProgrammaticLaunch() {
  static const bool capable = [] {  // one GPU a process
    BindThread();
    int device = 0, major = 0;
    TGIS_CUDA_CHECK(cudaGetDevice(&device));
    TGIS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major >= 9;
  }();
  return capable && !g_programmatic_off.load(std::memory_order_relaxed);
}

bool SetProgrammaticLaunch(bool on) {
  g_programmatic_off.store(!on, std::memory_order_relaxed);
  return ProgrammaticLaunch();
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

void* Malloc(size_t nbytes) {
  void* p = nullptr;
  if (nbytes == 0) nbytes = 1;  // a distinct pointer, as malloc gives
  const cudaError_t err = cudaMallocAsync(&p, nbytes, Stream());
  if (err != cudaSuccess) {
    // Warmup ran the largest step, so this is at start or a sizing that did not hold: say what
    // to change, with the numbers.
    (void)cudaGetLastError();
    size_t free_bytes = 0, total = 0;
    (void)cudaMemGetInfo(&free_bytes, &total);
    TGIS_FATAL(
        "CUDA out of memory: cudaMallocAsync(%zu bytes) failed (%s) with %zu of %zu MiB free on "
        "GPU %d; lower KV_CACHE_MEMORY_FRACTION, MAX_BATCH_WEIGHT or MAX_SEQUENCE_LENGTH, or "
        "raise BATCH_SAFETY_MARGIN",
        nbytes, cudaGetErrorString(err), free_bytes >> 20, total >> 20, CurrentDevice());
  }
  return p;
}

void Free(void* p) {
  if (p != nullptr) TGIS_CUDA_CHECK(cudaFreeAsync(p, Stream()));
}

void Memset(void* p, int value, size_t nbytes) {
  TGIS_CUDA_CHECK(cudaMemsetAsync(p, value, nbytes, Stream()));
}

void Copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  cudaMemcpyKind kind = cudaMemcpyDeviceToDevice;
  if (src_device == Device::kCpu) {
    kind = dst_device == Device::kCpu ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice;
  } else if (dst_device == Device::kCpu) {
    kind = cudaMemcpyDeviceToHost;
  }
  TGIS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, Stream()));
  // Synchronous to the caller: host memory may be reused as soon as this returns, and a copy
  // to the host is read next.
  if (kind != cudaMemcpyDeviceToDevice) TGIS_CUDA_CHECK(cudaStreamSynchronize(Stream()));
}

void SetDevice(int index) {
  TGIS_CUDA_CHECK(cudaSetDevice(index));
  t_device = index;
  g_device.store(index, std::memory_order_relaxed);
}

int CurrentDevice() {
  int device = -1;
  TGIS_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void* NativeStream() { return Stream(); }

void Synchronize() { TGIS_CUDA_CHECK(cudaStreamSynchronize(Stream())); }

size_t FreeMemory() {
  BindThread();
  size_t free_bytes = 0, total = 0;
  TGIS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

size_t TotalMemory() {
  BindThread();
  size_t free_bytes = 0, total = 0;
  TGIS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return total;
}

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

void CheckCudaFloat(const Tensor& t, const char* op, const char* what) {
  TGIS_CHECK(t.defined() && t.device() == Device::kCuda && IsFloat(t.dtype()),
             "%s: %s must be a CUDA f32/bf16/f16 tensor", op, what);
}

void CheckCudaIndex(const Tensor& t, const char* op, const char* what) {
  TGIS_CHECK(t.defined() && t.device() == Device::kCuda &&
                 (t.dtype() == DType::kI32 || t.dtype() == DType::kI64),
             "%s: %s must be a CUDA i32/i64 tensor", op, what);
}

void CheckCache(const KvCacheLayer& cache, DType act, const char* op) {
  CheckCudaFloat(cache.k, op, "cache k");
  CheckCudaFloat(cache.v, op, "cache v");
  TGIS_CHECK(cache.k.rank() == 4 && cache.k.shape() == cache.v.shape(),
             "%s: cache k and v must both be [num_blocks, block_size, Hk, D]", op);
  TGIS_CHECK(cache.k.dtype() == act && cache.v.dtype() == act,
             "%s: the cache dtype must be the activations' (%s)", op, DTypeName(act));
}

void PrepareOut(Tensor* out, const Shape& shape, DType dtype, const char* op) {
  if (!out->defined()) {
    *out = Tensor::Empty(shape, dtype, Device::kCuda);
    return;
  }
  TGIS_CHECK(out->shape() == shape && out->dtype() == dtype && out->device() == Device::kCuda,
             "%s: out is %s, want shape/dtype/device of the result", op,
             out->DebugString().c_str());
}

}  // namespace tgis::kernels::cuda

// Linear on CUDA through cuBLASLt: out = x @ w^T (+ bias in the GEMM's epilogue, as PyTorch's
// addmm does), f32 accumulation. Inputs share one dtype; the output is that dtype or f32 (the
// logits, which sampling wants unrounded). Plans (layouts and the heuristic's algorithm) are
// cached per shape, so a step's GEMMs cost no planning after the first time. Calls of a few rows
// (decode) take the GEMVs of gemv.cuh instead, dense or quantized; more rows on a quantized
// weight dequantize it for the GEMM.
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/warp_mma.cuh"
#include "kernels/cuda_ops.h"
#include "kernels/quantized.h"

// After the primitives they use (common.cuh, warp_mma.cuh); mma_gemv.cuh after gemv.cuh.
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/mma_gemv.cuh"

#define TGIS_CUBLAS_CHECK(expr)                                                  \
  do {                                                                           \
    const cublasStatus_t tgis_st_ = (expr);                                      \
    TGIS_CHECK(tgis_st_ == CUBLAS_STATUS_SUCCESS, "%s: cuBLAS status %d", #expr, \
               static_cast<int>(tgis_st_));                                      \
  } while (0)

namespace tgis::kernels::cuda {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      TGIS_FATAL("Linear: unsupported dtype %s", DTypeName(t));
  }
}

struct PlanKey {
  DType in, out;
  int64_t m, n, k;
  bool bias;
  uint32_t align;  // the least alignment of the operands' addresses, in bytes (<= 256)
  bool forced_fallback = false;  // ForceGemmFallbackForTesting
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fallback = false;  // cuBLASLt has no algorithm for it: FallbackGemm runs it
};

std::atomic<bool> g_force_fallback{false};
// SetTensorCoreGemv: 16-bit decode GEMVs on tensor cores (mma_gemv.cuh). Off until the H100
// has timed it against the CUDA-core GEMV (gpubench.engine_only --mma-gemv).
std::atomic<bool> g_mma_gemv{false};

// out[n, m] = x[n, k] @ w[m, k]^T (+ bias[m]), f32 accumulation: a plain tiled GEMM for the
// shapes and alignments cuBLASLt offers no algorithm for (a slow path that keeps the shard up,
// never the usual one). 16 x 16 output tiles; the bias is added in f32 before the one
// rounding, as cuBLASLt's epilogue does.
constexpr int kFallbackTile = 16;

template <typename T, typename TOut>
__global__ void FallbackGemmKernel(const T* w, const T* x, const T* bias, TOut* out, int64_t m,
                                   int64_t n, int64_t k) {
  PriorGridsDone();
  __shared__ float xs[kFallbackTile][kFallbackTile + 1], ws[kFallbackTile][kFallbackTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kFallbackTile + ty;  // of x and out
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kFallbackTile + tx;  // of w and out
  const int64_t w_row = static_cast<int64_t>(blockIdx.x) * kFallbackTile + ty;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < k; k0 += kFallbackTile) {
    const int64_t kk = k0 + tx;
    xs[ty][tx] = row < n && kk < k ? ToF32(x[row * k + kk]) : 0.0f;
    ws[ty][tx] = w_row < m && kk < k ? ToF32(w[w_row * k + kk]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kFallbackTile; ++j) acc += xs[ty][j] * ws[tx][j];
    __syncthreads();
  }
  if (row < n && col < m) {
    if (bias != nullptr) acc += ToF32(bias[col]);
    out[row * m + col] = FromF32<TOut>(acc);
  }
}

class Gemms {
 public:
  static Gemms& Get() {
    static Gemms* g = new Gemms();  // lives as long as the process (no teardown ordering)
    return *g;
  }

  // C[m, n] (column-major) = op(A) B with A = w ([k, m] column-major, transposed) and
  // B = x ([k, n] column-major): the row-major out[n, m] = x[n, k] @ w[m, k]^T.
  void Run(const PlanKey& key, const void* w, const void* x, const void* bias, void* out) {
    std::lock_guard<std::mutex> lock(mu_);
    Plan& p = PlanFor(key);
    if (!p.fallback) {
      if (key.bias) {
        TGIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                         &bias, sizeof(bias)));
      }
      const float one = 1.0f, zero = 0.0f;
      const cublasStatus_t st =
          cublasLtMatmul(handle_, p.desc, &one, w, p.a, x, p.b, &zero, out, p.c, out, p.c, &p.algo,
                         workspace_, kWorkspaceBytes, Stream());
      if (st == CUBLAS_STATUS_SUCCESS) return;
      // The heuristic's algorithm refused the call (CUBLAS_STATUS_NOT_SUPPORTED and the like):
      // this shape takes the fallback from now on.
      Refuse(key, "cublasLtMatmul", st, &p);
    }
    FallbackGemm(key, w, x, bias, out);
  }

 private:
  Gemms() {
    BindThread();  // the workspace goes on the shard's GPU
    TGIS_CUBLAS_CHECK(cublasLtCreate(&handle_));
    TGIS_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }

  Plan& PlanFor(const PlanKey& key) {
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan p;
    // f32 inputs: full f32 (no TF32), as PyTorch's default for matmuls.
    TGIS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
    TGIS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
    TGIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans,
                                                     sizeof(no_trans)));
    if (key.bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      TGIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                       &epilogue, sizeof(epilogue)));
      const cudaDataType_t bias_type = CudaType(key.in);
      TGIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                       &bias_type, sizeof(bias_type)));
    }
    const cudaDataType_t in = CudaType(key.in), out = CudaType(key.out);
    TGIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in, key.k, key.m, key.k));
    TGIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in, key.k, key.n, key.k));
    TGIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, out, key.m, key.n, key.m));
    cublasLtMatmulPreference_t pref = nullptr;
    TGIS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    TGIS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    // Views (a tensor's rows) may start off the allocator's 256-byte alignment: ask only for
    // algorithms that accept the operands as they are.
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      TGIS_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(pref, attr, &key.align, sizeof(key.align)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c,
                                                             pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    p.algo = result.algo;
    if (key.forced_fallback) {
      p.fallback = true;
    } else if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      Refuse(key, "cublasLtMatmulAlgoGetHeuristic",
             st != CUBLAS_STATUS_SUCCESS ? st : CUBLAS_STATUS_NOT_SUPPORTED, &p);
    }
    return plans_.emplace(key, p).first->second;
  }

  // Marks a plan for the fallback GEMM, saying so once on stderr (the kernels log nowhere else).
  static void Refuse(const PlanKey& key, const char* call, cublasStatus_t st, Plan* p) {
    std::fprintf(stderr,
                 "Linear: %s gave cuBLAS status %d for %s -> %s, m=%lld n=%lld k=%lld (operands "
                 "aligned to %u bytes): this shape runs on the fallback GEMM\n",
                 call, static_cast<int>(st), DTypeName(key.in), DTypeName(key.out),
                 static_cast<long long>(key.m), static_cast<long long>(key.n),
                 static_cast<long long>(key.k), key.align);
    p->fallback = true;
  }

  static void FallbackGemm(const PlanKey& key, const void* w, const void* x, const void* bias,
                           void* out) {
    const dim3 block(kFallbackTile, kFallbackTile);
    const dim3 grid(static_cast<unsigned>((key.m + kFallbackTile - 1) / kFallbackTile),
                    static_cast<unsigned>((key.n + kFallbackTile - 1) / kFallbackTile));
    TGIS_DISPATCH_FLOAT(key.in, "Linear", {
      const T* bt = key.bias ? static_cast<const T*>(bias) : nullptr;
      if (key.out == DType::kF32) {
        Launch(FallbackGemmKernel<T, float>, grid, block, static_cast<const T*>(w),
               static_cast<const T*>(x), bt, static_cast<float*>(out), key.m, key.n, key.k);
      } else {
        Launch(FallbackGemmKernel<T, T>, grid, block, static_cast<const T*>(w),
               static_cast<const T*>(x), bt, static_cast<T*>(out), key.m, key.n, key.k);
      }
    });
  }

  std::mutex mu_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<PlanKey, Plan> plans_;
};

// The largest power of two (up to 256) that divides every address.
uint32_t Alignment(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 256;
  for (const void* p : ptrs) {
    if (p != nullptr) bits |= reinterpret_cast<uintptr_t>(p);
  }
  return static_cast<uint32_t>(bits & (~bits + 1));
}

CodeValues CodeValuesOf(const QuantizedWeight& q) {
  CodeValues v;
  if (!q.codebook.empty()) {
    v.kind = CodeValues::kTable;
    for (int i = 0; i < 16; ++i) v.table[i] = q.codebook[i];
  } else if (q.fp8) {
    v.kind = CodeValues::kFp8;
  }
  return v;
}

// dense[n, gather(j)] = (code[n, j] - zero[n, run(j)]) * scale[n, run(j)] (kernels/quantized.h's
// layout): blockIdx.y strides over rows, threads over a row's stored codes.
template <typename T>
__global__ void DequantizeKernel(const uint8_t* codes, int64_t code_row, int bits,
                                 CodeValues values, const float* scales, const float* zeros,
                                 int64_t runs, const int32_t* block_run, const int32_t* gather,
                                 int64_t out, int64_t in, int64_t stored_in, T* dense) {
  PriorGridsDone();
  __shared__ float table[16];
  const CodeTable v = LoadCodeTable(values, table);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= stored_in) return;
  const int64_t col = gather != nullptr ? gather[j] : j;
  if (col < 0) return;
  const int32_t run = block_run[j / 8];
  for (int64_t n = blockIdx.y; n < out; n += gridDim.y) {
    const uint8_t* row = codes + n * code_row;
    const uint32_t code = bits == 8 ? row[j] : (row[j / 2] >> (4 * (j % 2))) & 0xF;
    const int64_t r = n * runs + run;
    dense[n * in + col] = FromF32<T>((CodeValue(v, code) - zeros[r]) * scales[r]);
  }
}

// x's columns in a weight's stored order (act-order GPTQ stores its columns group by group):
// xs[t, j] = x[t, gather[j]], zero for padding (-1), so the wide kernel reads x as it reads
// the codes.
template <typename T>
__global__ void GatherColumnsKernel(const T* x, int64_t in, const int32_t* gather,
                                    int64_t stored_in, T* xs) {
  PriorGridsDone();
  const int64_t t = blockIdx.y;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < stored_in;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t col = gather[j];
    xs[t * stored_in + j] = col >= 0 ? x[t * in + col] : FromF32<T>(0.0f);
  }
}

// Whether the wide kernel takes q and x: rows of whole 16-byte vectors of codes, and x's rows
// 16-byte aligned in the stored column order (a weight with a gather gets a gathered copy).
bool QuantizedGemvWideTakes(const QuantizedWeight& q, const Tensor& x) {
  const bool x_as_stored =
      !q.gather.defined() && q.stored_in == q.in && reinterpret_cast<uintptr_t>(x.raw()) % 16 == 0;
  return (q.gather.defined() || x_as_stored) && q.code_bytes_per_row() % 16 == 0 &&
         q.stored_in % 8 == 0 && reinterpret_cast<uintptr_t>(q.codes.raw()) % 16 == 0;
}

// Whether the tensor-core kernel (SetTensorCoreGemv) takes q and x, given that the wide one
// does: 4-bit integer codes, runs of whole 128-column chunks, and zeros that T's magic value
// holds exactly (MmaQuantGemvKernel).
bool MmaQuantGemvTakes(const QuantizedWeight& q, DType x_dtype) {
  const int64_t most_zero = x_dtype == DType::kBF16 ? 127 : 1023;
  return g_mma_gemv.load(std::memory_order_relaxed) && x_dtype != DType::kF32 && q.bits == 4 &&
         q.codebook.empty() && !q.fp8 && q.run_alignment >= kMmaQuantChunkCols && q.max_zero >= 0 &&
         q.max_zero <= most_zero;
}

void QuantizedGemv(const QuantizedWeight& q, const Tensor& x, int64_t tokens, const Tensor* bias,
                   Tensor* out) {
  TGIS_CHECK(!q.compact(), "Linear: a compact quantized weight reached CUDA without widening");
  TGIS_CHECK(q.code_bytes_per_row() % 4 == 0, "Linear: quantized rows of %lld code bytes",
             static_cast<long long>(q.code_bytes_per_row()));
  TGIS_CHECK((q.codebook.empty() || q.bits == 4) && (!q.fp8 || q.bits == 8),
             "Linear: a codebook needs 4-bit codes and float8 8-bit ones (bits %d)", q.bits);
  const unsigned blocks = Blocks(q.out, kGemvWarps);
  const bool f32_out = out->dtype() == DType::kF32;
  TGIS_DISPATCH_FLOAT(x.dtype(), "Linear", {
    const T* b = bias != nullptr && bias->defined() ? bias->data<T>() : nullptr;
    const bool wide = QuantizedGemvWideTakes(q, x);
    const bool mma = wide && MmaQuantGemvTakes(q, x.dtype());
    const T* xs = x.data<T>();
    int64_t xs_in = q.in;
    Tensor gathered;
    if (wide && q.gather.defined()) {
      gathered = Tensor::Empty({tokens, q.stored_in}, x.dtype(), Device::kCuda);
      Launch(GatherColumnsKernel<T>, dim3(Blocks(q.stored_in, 256), static_cast<unsigned>(tokens)),
             256, x.data<T>(), q.in, q.gather.data<int32_t>(), q.stored_in, gathered.data<T>());
      xs = gathered.data<T>();
      xs_in = q.stored_in;
    }
    auto launch = [&](auto* y) {
      using TOut = std::remove_pointer_t<decltype(y)>;
      const int k = static_cast<int>(tokens);
      if (!wide) {
        Launch(QuantizedGemvKernel<T, TOut>, blocks, kGemvWarps * 32, q.codes.data<uint8_t>(),
               q.codes.dim(1), q.bits, CodeValuesOf(q), q.scales.data<float>(),
               q.zeros.data<float>(), q.runs(), q.block_run.data<int32_t>(),
               q.gather.defined() ? q.gather.data<int32_t>() : nullptr, q.out, q.in, x.data<T>(), k,
               b, y);
        return;
      }
      if constexpr (!std::is_same_v<T, float>) {
        if (mma) {
          Launch(k <= kGemvTokens ? MmaQuantGemvKernel<T, TOut, kGemvTokens>
                                  : MmaQuantGemvKernel<T, TOut, kQuantizedGemvTokens>,
                 Blocks(q.out, kMmaGemvRows), kMmaGemvWarps * 32, q.codes.data<uint8_t>(),
                 q.codes.dim(1), q.scales.data<float>(), q.zeros.data<float>(), q.runs(),
                 q.block_run.data<int32_t>(), q.out, xs_in, xs, k, b, y);
          return;
        }
      }
      auto go = [&](auto kernel) {
        Launch(kernel, blocks, kGemvWarps * 32, q.codes.data<uint8_t>(), q.codes.dim(1),
               CodeValuesOf(q), q.scales.data<float>(), q.zeros.data<float>(), q.runs(),
               q.block_run.data<int32_t>(), q.out, xs_in, xs, k, b, y);
      };
      // One accumulator for batch-1 decode; eight or sixteen for the rest.
      if (q.bits == 4 && k == 1) {
        go(QuantizedGemvWideKernel<T, TOut, 1, 4>);
      } else if (q.bits == 4 && k <= kGemvTokens) {
        go(QuantizedGemvWideKernel<T, TOut, kGemvTokens, 4>);
      } else if (q.bits == 4) {
        go(QuantizedGemvWideKernel<T, TOut, kQuantizedGemvTokens, 4>);
      } else if (k == 1) {
        go(QuantizedGemvWideKernel<T, TOut, 1, 8>);
      } else if (k <= kGemvTokens) {
        go(QuantizedGemvWideKernel<T, TOut, kGemvTokens, 8>);
      } else {
        go(QuantizedGemvWideKernel<T, TOut, kQuantizedGemvTokens, 8>);
      }
    };
    if (f32_out) {
      launch(out->data<float>());
    } else {
      launch(out->data<T>());
    }
  });
}

// Whether DenseGemv takes the call: few rows, whole 16-byte vectors, aligned operands.
bool DenseGemvTakes(const Tensor& x, const Tensor& w, int64_t rows) {
  const int64_t vec = 16 / static_cast<int64_t>(DTypeSize(x.dtype()));
  return rows <= kGemvTokens && w.dim(1) % vec == 0 &&
         reinterpret_cast<uintptr_t>(w.raw()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x.raw()) % 16 == 0;
}

void DenseGemv(const Tensor& w, const Tensor& x, int64_t tokens, const Tensor* bias, Tensor* out) {
  const int64_t out_f = w.dim(0), in = w.dim(1);
  const bool f32_out = out->dtype() == DType::kF32;
  const bool mma = x.dtype() != DType::kF32 && g_mma_gemv.load(std::memory_order_relaxed);
  TGIS_DISPATCH_FLOAT(x.dtype(), "Linear", {
    const T* b = bias != nullptr && bias->defined() ? bias->data<T>() : nullptr;
    auto launch = [&](auto* y) {
      using TOut = std::remove_pointer_t<decltype(y)>;
      const int k = static_cast<int>(tokens);
      if constexpr (!std::is_same_v<T, float>) {
        if (mma) {
          Launch(MmaGemvKernel<T, TOut>, Blocks(out_f, kMmaGemvRows), kMmaGemvWarps * 32,
                 w.data<T>(), out_f, in, x.data<T>(), k, b, y);
          return;
        }
      }
      auto go = [&](auto kernel) {
        Launch(kernel, Blocks(out_f, kGemvWarps), kGemvWarps * 32, w.data<T>(), out_f, in,
               x.data<T>(), k, b, y);
      };
      if (k == 1) {
        go(DenseGemvKernel<T, TOut, 1>);
      } else if (k == 2) {
        go(DenseGemvKernel<T, TOut, 2>);
      } else if (k <= 4) {
        go(DenseGemvKernel<T, TOut, 4>);
      } else {
        go(DenseGemvKernel<T, TOut, 8>);
      }
    };
    if (f32_out) {
      launch(out->data<float>());
    } else {
      launch(out->data<T>());
    }
  });
}

// The dense weight of x's dtype that a quantized one stands for, for calls of more tokens than
// the GEMV takes.
// TODO(issue 14): a fused int4/int8 GEMM (Marlin style) for prefill in place of this
// dequantize-then-GEMM, which reads the weight three times and allocates per call.
Tensor DequantizeOnDevice(const QuantizedWeight& q, DType dtype) {
  // QuantizedToDevice widened compact run constants to the f32 this kernel reads.
  TGIS_CHECK(!q.compact(), "Linear: a compact quantized weight reached CUDA without widening");
  Tensor dense = Tensor::Empty({q.out, q.in}, dtype, Device::kCuda);
  if (q.out == 0 || q.stored_in == 0) return dense;
  const int threads = 256;
  const dim3 grid(Blocks(q.stored_in, threads),
                  static_cast<unsigned>(std::min<int64_t>(q.out, 65535)));
  TGIS_DISPATCH_FLOAT(
      dtype, "Linear",
      Launch(DequantizeKernel<T>, grid, threads, q.codes.data<uint8_t>(), q.codes.dim(1), q.bits,
             CodeValuesOf(q), q.scales.data<float>(), q.zeros.data<float>(), q.runs(),
             q.block_run.data<int32_t>(), q.gather.defined() ? q.gather.data<int32_t>() : nullptr,
             q.out, q.in, q.stored_in, dense.data<T>()));
  return dense;
}

}  // namespace

void ForceGemmFallbackForTesting(bool on) { g_force_fallback.store(on, std::memory_order_relaxed); }

void SetTensorCoreGemv(bool on) { g_mma_gemv.store(on, std::memory_order_relaxed); }

void Linear(const Tensor& x, const Tensor& w_in, const Tensor* bias, Tensor* out) {
  const char* op = "Linear";
  CheckCudaFloat(x, op, "x");
  const QuantizedWeight* q = w_in.quantized();
  if (q == nullptr) {
    CheckCudaFloat(w_in, op, "w");
    TGIS_CHECK(w_in.rank() == 2 && w_in.dtype() == x.dtype(),
               "%s: w must be [out, in] of x's dtype (%s)", op, DTypeName(x.dtype()));
  }
  const int64_t in = w_in.dim(1), out_f = w_in.dim(0);
  TGIS_CHECK(x.dim(-1) == in, "%s: x has %lld features, w wants %lld", op,
             static_cast<long long>(x.dim(-1)), static_cast<long long>(in));
  const int64_t rows = x.numel() / in;
  const bool has_bias = bias != nullptr && bias->defined();
  if (has_bias) {
    CheckCudaFloat(*bias, op, "bias");
    TGIS_CHECK(bias->numel() == out_f && bias->dtype() == x.dtype(), "%s: bias must be [%lld] %s",
               op, static_cast<long long>(out_f), DTypeName(x.dtype()));
  }
  Shape shape = x.shape();
  shape.back() = out_f;
  // A defined f32 `out` asks for f32 results from lower-precision inputs.
  const DType out_dtype = out->defined() && out->dtype() == DType::kF32 ? DType::kF32 : x.dtype();
  PrepareOut(out, shape, out_dtype, op);
  if (rows == 0 || out_f == 0) return;
  if (in == 0) {
    Memset(out->raw(), 0, out->nbytes());
    TGIS_CHECK(!has_bias, "%s: a bias with no input features", op);
    return;
  }
  if (q != nullptr && rows <= kQuantizedGemvTokens) return QuantizedGemv(*q, x, rows, bias, out);
  if (q == nullptr && !g_force_fallback.load(std::memory_order_relaxed) &&
      DenseGemvTakes(x, w_in, rows)) {
    return DenseGemv(w_in, x, rows, bias, out);
  }
  const Tensor w = q != nullptr ? DequantizeOnDevice(*q, x.dtype()) : w_in;
  const void* b = has_bias ? bias->raw() : nullptr;
  const uint32_t align = Alignment({w.raw(), x.raw(), b, out->raw()});
  Gemms::Get().Run({x.dtype(), out_dtype, out_f, rows, in, has_bias, align,
                    g_force_fallback.load(std::memory_order_relaxed)},
                   w.raw(), x.raw(), b, out->raw());
}

}  // namespace tgis::kernels::cuda

// Linear on CUDA through cuBLASLt: out = x @ w^T (+ bias in the GEMM's epilogue, as PyTorch's
// addmm does), f32 accumulation. Inputs share one dtype; the output is that dtype or f32 (the
// logits, which sampling wants unrounded). Plans (layouts and the heuristic's algorithm) are
// cached per shape, so a step's GEMMs cost no planning after the first time.
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
#include "kernels/cuda_ops.h"
#include "kernels/quantized.h"

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
    TGIS_CUDA_LAUNCHED();
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

// float8 e4m3fn to f32 as kernels::Fp8E4M3ToF32 (the loader rejects NaN codes).
__device__ inline float Fp8E4M3ToF32Device(uint32_t v) {
  const uint32_t bits = ((v & 0x7F) << 20) | ((v & 0x80) << 24);
  return __uint_as_float(bits) * 0x1p120f;
}

// What a code stands for before its zero and scale: the integer itself, a float8 e4m3 value,
// or an entry of a 16-value table (QuantizedWeight::codebook); passed to kernels by value and
// read by them through CodeTable.
struct CodeValues {
  enum Kind { kInteger, kFp8, kTable } kind = kInteger;
  float table[16] = {};
};

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

// A kernel's view of CodeValues, its table in shared memory: a by-value parameter indexed by
// a run-time code is copied to local memory by every thread, and on the H100 that made nf4
// decode four times slower than int8. Call from every thread of the block, before any returns.
struct CodeTable {
  CodeValues::Kind kind;
  const float* table;
};

__device__ __forceinline__ CodeTable LoadCodeTable(const CodeValues& values, float* shared) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) shared[i] = values.table[i];
  }
  __syncthreads();
  return {values.kind, shared};
}

// 2^23 + c for a small integer c as float bits: the integer's value as (bits - 2^23) with
// integer operations and one exact subtraction, where I2F would take the conversion unit (an
// eighth of the FMA rate on the H100, and what bounded int8 decode there).
constexpr uint32_t kMagicBits = 0x4B000000u;
constexpr float kMagic = 8388608.0f;

__device__ __forceinline__ float CodeValue(const CodeTable& v, uint32_t code) {
  return v.kind == CodeValues::kTable ? v.table[code & 15]
         : v.kind == CodeValues::kFp8 ? Fp8E4M3ToF32Device(code)
                                      : __uint_as_float(kMagicBits | code) - kMagic;
}

// The values of the eight codes of one 8-column block: `lo` holds them (4-bit) or the first
// four (8-bit, `hi` the other four). The kind is tested once per block, not per code; a table
// comes with 4-bit codes only and float8 with 8-bit ones (QuantizedGemv checks).
template <int kBits>
__device__ __forceinline__ void BlockCodeValues(const CodeTable& v, uint32_t lo, uint32_t hi,
                                                float* out) {
  if (v.kind == CodeValues::kInteger) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t bits = kBits == 8 ? __byte_perm(i < 4 ? lo : hi, 0x4B00u, 0x5440u + i % 4)
                                       : kMagicBits | ((lo >> (4 * i)) & 0xF);
      out[i] = __uint_as_float(bits) - kMagic;
    }
  } else if constexpr (kBits == 4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = v.table[(lo >> (4 * i)) & 0xF];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = Fp8E4M3ToF32Device(((i < 4 ? lo : hi) >> (8 * (i % 4))) & 0xFF);
  }
}

// Rounds eight f32 values to T and back, two to a conversion (cvt.rn.bf16x2.f32 / f16x2): the
// weight x's dtype stands for, as the dequantize-then-GEMM path writes it.
template <typename T>
__device__ __forceinline__ void RoundThrough(float* w) {
  if constexpr (std::is_same_v<T, bf16>) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const __nv_bfloat162 r = __floats2bfloat162_rn(w[i], w[i + 1]);
      w[i] = __low2float(r), w[i + 1] = __high2float(r);
    }
  } else if constexpr (std::is_same_v<T, f16>) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const float2 r = __half22float2(__floats2half2_rn(w[i], w[i + 1]));
      w[i] = r.x, w[i + 1] = r.y;
    }
  }
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

// Decode-sized calls (at most kQuantizedGemvTokens rows of x) on a quantized weight: out[t, n] =
// sum over stored columns j of x[t, gather(j)] * w(n, j) (+ bias[n]), where w(n, j) is the
// value DequantizeKernel would write (dequantized in f32, rounded to x's dtype), multiplied and
// summed in f32: what the dequantize-then-GEMM path computes, up to the order of the sum, while
// reading each code once (4-bit: a quarter of the bytes of a bf16 weight) and allocating
// nothing. One warp per output row; lane l reads 4 code bytes at a time, so each warp load is
// 128 contiguous bytes of the row, and every 4 bytes lie in one 8-column block (one run).
// 16 tokens: batch-16 decode dequantized every weight per step before (141 ms a step for the
// 8B shape on the H100, against 8.7 in bf16).
constexpr int kGemvTokens = 8;
constexpr int kQuantizedGemvTokens = 16;
constexpr int kGemvWarps = 8;  // output rows per thread block

template <typename T, typename TOut>
__global__ void QuantizedGemvKernel(const uint8_t* codes, int64_t code_row, int bits,
                                    CodeValues values, const float* scales, const float* zeros,
                                    int64_t runs, const int32_t* block_run, const int32_t* gather,
                                    int64_t out, int64_t in, const T* x, int tokens, const T* bias,
                                    TOut* y) {
  PriorGridsDone();
  __shared__ float table[16];
  const CodeTable v = LoadCodeTable(values, table);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) return;  // the whole warp: n is the same for its lanes
  const uint32_t* row = reinterpret_cast<const uint32_t*>(codes + n * code_row);
  const float* row_scale = scales + n * runs;
  const float* row_zero = zeros + n * runs;
  const int per_word = bits == 8 ? 4 : 8;
  const int64_t words = code_row / 4;
  float acc[kQuantizedGemvTokens] = {};
  for (int64_t wi = lane; wi < words; wi += 32) {
    const uint32_t word = row[wi];
    const int64_t j0 = wi * per_word;
    const int64_t run = block_run[j0 / 8];
    const float scale = row_scale[run], zero = row_zero[run];
    for (int i = 0; i < per_word; ++i) {
      const int64_t col = gather != nullptr ? gather[j0 + i] : j0 + i;
      if (col < 0) continue;  // padding
      const uint32_t code = bits == 8 ? (word >> (8 * i)) & 0xFF : (word >> (4 * i)) & 0xF;
      const float w = ToF32(FromF32<T>((CodeValue(v, code) - zero) * scale));
#pragma unroll
      for (int t = 0; t < kQuantizedGemvTokens; ++t) {
        if (t < tokens) acc[t] += w * ToF32(x[t * in + col]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kQuantizedGemvTokens; ++t) {
    if (t >= tokens) break;
    const float sum = WarpSum(acc[t]);
    if (lane == 0) y[t * out + n] = FromF32<TOut>(bias != nullptr ? sum + ToF32(bias[n]) : sum);
  }
}

// Streams a row of `vecs` 16-byte vectors through accumulate(vector, index): lane l takes
// vectors l, l + 32, ..., kUnroll at a time, and the next kUnroll loads are issued before this
// chunk's arithmetic, so they are in flight while it runs (loads bypass L1: each byte is read
// once). Without that, ptxas sank each load next to its use to save registers (2 of 4 in
// flight, SASS showed), and batch-1 decode of the 8B shape ran at 13.5 ms/token against
// cuBLASLt's 9.0 on the H100.
// PriorGridsDone comes after the first kUnroll loads and a prefetch of the chunk after them into
// L2 (a weight is no kernel's output): with programmatic dependent launch two chunks a warp
// (4 KB of a bf16 row) stream from the HBM while the kernel before (a norm, attention, the
// gated activation) finishes, and accumulate, which reads x, runs after it.
template <int kUnroll, typename Accumulate>
__device__ __forceinline__ void StreamRow(const uint4* row, int64_t vecs, int lane,
                                          Accumulate&& accumulate) {
  constexpr int64_t kChunk = 32 * kUnroll;  // vectors per warp and chunk
  const int64_t chunks = vecs / kChunk;
  uint4 cur[kUnroll];
  if (chunks > 0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) cur[u] = __ldcs(row + lane + 32 * u);
  }
  constexpr int kLines = kChunk * 16 / 128;  // 128-byte lines a chunk: one a lane
  if (chunks > 1 && lane < kLines) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + kChunk + lane * 8));
  }
  PriorGridsDone();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t v = c * kChunk + lane;
    uint4 next[kUnroll];
    const bool more = c + 1 < chunks;
    if (more) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) next[u] = __ldcs(row + v + kChunk + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) accumulate(cur[u], v + 32 * u);
    if (more) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) cur[u] = next[u];
    }
  }
  for (int64_t v = chunks * kChunk + lane; v < vecs; v += 32) accumulate(__ldcs(row + v), v);
}

// Eight consecutive values of x as f32 (16- or 32-byte aligned loads).
template <typename T>
__device__ __forceinline__ void LoadX8(const T* p, float* v) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ToF32(e[i]);
  }
}

// One 16-byte vector of codes (whole 8-column blocks starting at column col0) into the
// accumulators: each weight dequantized as QuantizedGemvKernel does it.
template <typename T, int kTokens, int kBits>
__device__ __forceinline__ void AccumulateCodes(const uint4& vec, int64_t col0, const CodeTable& v,
                                                const float* row_scale, const float* row_zero,
                                                const int32_t* block_run, const T* x, int64_t in,
                                                int tokens, float* acc) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&vec);
  constexpr int kBlocks = 16 / kBits;  // 8-column blocks per vector: 4 (4-bit) or 2 (8-bit)
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t col = col0 + 8 * b;
    const int32_t run = block_run[col / 8];
    const float scale = row_scale[run], zero = row_zero[run];
    float w[8];
    if constexpr (kBits == 8) {
      BlockCodeValues<8>(v, words[2 * b], words[2 * b + 1], w);
    } else {
      BlockCodeValues<4>(v, words[b], 0, w);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = (w[i] - zero) * scale;
    RoundThrough<T>(w);
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (t < tokens) {
        float xv[8];
        LoadX8(x + t * in + col, xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t] += w[i] * xv[i];
      }
    }
  }
}

// The wide path of the quantized GEMV, for rows of whole 16-byte vectors of codes, x in the
// stored column order (gathered first for act-order weights): each lane reads 16 bytes of codes at
// a time (32 4-bit or 16 8-bit codes), two more in flight while these are dequantized (StreamRow),
// and x eight values at a time. The scalar kernel above read 4 bytes and one x value at a time,
// with a gather lookup per column.
template <typename T, typename TOut, int kTokens, int kBits>
__global__ void __launch_bounds__(kGemvWarps * 32)
    QuantizedGemvWideKernel(const uint8_t* codes, int64_t code_row, CodeValues values,
                            const float* scales, const float* zeros, int64_t runs,
                            const int32_t* block_run, int64_t out, int64_t in, const T* x,
                            int tokens, const T* bias, TOut* y) {
  constexpr int64_t kCols = 128 / kBits;  // columns per vector
  __shared__ float table[16];
  const CodeTable v = LoadCodeTable(values, table);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) {  // the whole warp
    PriorGridsDone();
    return;
  }
  const float* row_scale = scales + n * runs;
  const float* row_zero = zeros + n * runs;
  float acc[kTokens] = {};
  StreamRow<2>(reinterpret_cast<const uint4*>(codes + n * code_row), code_row / 16, lane,
               [&](const uint4& vec, int64_t vi) {
                 AccumulateCodes<T, kTokens, kBits>(vec, vi * kCols, v, row_scale, row_zero,
                                                    block_run, x, in, tokens, acc);
               });
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t >= tokens) break;
    const float sum = WarpSum(acc[t]);
    if (lane == 0) y[t * out + n] = FromF32<TOut>(bias != nullptr ? sum + ToF32(bias[n]) : sum);
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
  TGIS_CUDA_LAUNCHED();
}

// Decode-sized calls (at most kGemvTokens rows of x) on a dense weight: out[t, n] = x[t] . w[n]
// (+ bias[n]), f32 products and sums. Decode streams every weight once per step, so this is a
// copy at the HBM's speed or nothing: one warp per output row reads the row in 16-byte loads,
// four in flight per lane, bypassing L1 (each weight byte is read once; x, re-read by every
// warp, stays cached). On the H100 cuBLASLt's split-K choices for one row of x ran the 8B
// shape's o_proj at half the copy bandwidth and added a reduction kernel per GEMM. A token's
// sum does not depend on how many rows come with it, so decode is batch invariant up to 8.
template <typename T, int kTokens>
__device__ __forceinline__ void AccumulateVec(const uint4& wv, const T* x, int64_t in, int64_t col,
                                              int tokens, float* acc) {
  constexpr int kVec = 16 / sizeof(T);
  const T* wp = reinterpret_cast<const T*>(&wv);
  float wf[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) wf[i] = ToF32(wp[i]);
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t < tokens) {
      const uint4 xv = *reinterpret_cast<const uint4*>(x + t * in + col);
      const T* xp = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[t] += wf[i] * ToF32(xp[i]);
    }
  }
}

// kTokens (1, 2, 4 or 8) bounds the rows of x (fewer accumulators, fewer registers); four
// 16-byte weight loads in flight per lane (StreamRow).
template <typename T, typename TOut, int kTokens>
__global__ void __launch_bounds__(kGemvWarps * 32)
    DenseGemvKernel(const T* w, int64_t out, int64_t in, const T* x, int tokens, const T* bias,
                    TOut* y) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= out) {  // the whole warp: n is the same for its lanes
    PriorGridsDone();
    return;
  }
  float acc[kTokens] = {};
  StreamRow<4>(reinterpret_cast<const uint4*>(w + n * in), in / kVec, lane,
               [&](const uint4& wv, int64_t v) {
                 AccumulateVec<T, kTokens>(wv, x, in, v * kVec, tokens, acc);
               });
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t >= tokens) break;
    const float sum = WarpSum(acc[t]);
    if (lane == 0) y[t * out + n] = FromF32<TOut>(bias != nullptr ? sum + ToF32(bias[n]) : sum);
  }
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
  const unsigned blocks = Blocks(out_f, kGemvWarps);
  const bool f32_out = out->dtype() == DType::kF32;
  TGIS_DISPATCH_FLOAT(x.dtype(), "Linear", {
    const T* b = bias != nullptr && bias->defined() ? bias->data<T>() : nullptr;
    auto launch = [&](auto* y) {
      using TOut = std::remove_pointer_t<decltype(y)>;
      const int k = static_cast<int>(tokens);
      auto go = [&](auto kernel) {
        Launch(kernel, blocks, kGemvWarps * 32, w.data<T>(), out_f, in, x.data<T>(), k, b, y);
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
  TGIS_CUDA_LAUNCHED();
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
  TGIS_CUDA_LAUNCHED();
  return dense;
}

}  // namespace

void ForceGemmFallbackForTesting(bool on) { g_force_fallback.store(on, std::memory_order_relaxed); }

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

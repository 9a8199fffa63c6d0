// The CUDA implementations of the ops in ops.h, and the device memory hooks Tensor uses.
// Declared always; defined only in builds with CUDA (TGIS_WITH_CUDA, by kernels/cuda/*.cu).
// All work goes on one stream in order; copies to or from the host return when done. The dispatcher
// in ops.cc calls these for Device::kCuda tensors.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace tgis::kernels::cuda {

// Memory.
int DeviceCount();
void* Malloc(size_t nbytes);
void Free(void* p);
void Memset(void* p, int value, size_t nbytes);
// A synchronous copy between any two devices (host <-> device, device <-> device).
void Copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
// Selects this process's GPU; call before any other CUDA work. Every thread that later runs
// CUDA work through these functions is bound to it on its first call.
void SetDevice(int index);
// The calling thread's current device (tests, logs).
int CurrentDevice();
// While on, Linear runs the fallback GEMM, which otherwise runs only for the shapes and
// alignments cuBLASLt has no algorithm for (tests).
void ForceGemmFallbackForTesting(bool on);
// On: decode GEMVs of bf16/f16 weights (up to 8 rows of x), and of 4-bit integer codes in runs
// of whole 128-column chunks (GPTQ/AWQ groups of 128 or per channel; up to 16 rows), run on
// tensor cores (mma_gemv.cuh) instead of CUDA cores; off by default. Each path is batch
// invariant by itself; the two differ in the order of their sums.
void SetTensorCoreGemv(bool on);
// Keys per partition of the grouped decode attention kernel (0: its default), for
// attention_bench to compare sizes in one run.
void SetGroupedPartitionKeysForTesting(int keys);
// Off: where blocks queue, the grouped decode attention kernel loads its rows directly rather
// than staging them in shared memory (the same bits), for attention_bench to compare in one run.
void SetGroupedStagingForTesting(bool on);
// Programmatic dependent launch of the kernels (kernels/cuda/common.cuh's Launch), on by
// default where the GPU has it: off, kernels start in plain stream order (benchmarks compare
// the two in one run). Returns whether it is now in effect.
bool SetProgrammaticLaunch(bool on);
// The process's stream (a cudaStream_t), for libraries that queue work on it (NCCL).
void* NativeStream();
// Waits for everything queued on the process's stream.
void Synchronize();
// Free device memory in bytes (what the KV cache may take at Warmup).
size_t FreeMemory();
// The device's whole memory in bytes.
size_t TotalMemory();

// Graphs (decode steps). Between BeginCapture and EndCapture the work queued on the stream is
// recorded, not run (nothing in between may synchronize with the host: no copy to or from
// it). EndCapture gives the instantiated graph, or null (logged) when recording or
// instantiation failed; LaunchGraph replays it on the stream (false, logged, when the launch
// failed, e.g. for lack of memory for the graph's allocations).
void BeginCapture();
void* EndCapture();
bool LaunchGraph(void* graph);
void DestroyGraph(void* graph);
// Device memory the driver holds for graphs' own allocations.
size_t GraphMemoryBytes();

// Ops: same contracts as in ops.h.
#include "kernels/op_signatures.inc"

}  // namespace tgis::kernels::cuda

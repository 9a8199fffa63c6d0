// CUDA graphs of decode steps: the work a forward pass queues on the process's stream is
// recorded once per shape and replayed with one launch, so a step of the 8B shape costs one
// host call instead of ~260 kernel launches (each a few microseconds of host time that the GPU
// waited for between the small kernels).
#include <cstdio>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda_ops.h"

namespace tgis::kernels::cuda {

void BeginCapture() {
  // Relaxed: a first-use allocation on the host side (cuBLASLt's workspace) may happen inside;
  // the stream-ordered allocations of the forward pass become the graph's own memory nodes.
  TGIS_CUDA_CHECK(cudaStreamBeginCapture(Stream(), cudaStreamCaptureModeRelaxed));
}

void* EndCapture() {
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(Stream(), &graph);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "CUDA graph capture failed (%s); steps of this shape run eagerly\n",
                 cudaGetErrorString(err));
    return nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  // Memory a graph allocates and does not free (none should) is freed at its next launch.
  err = cudaGraphInstantiateWithFlags(&exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch);
  (void)cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "CUDA graph instantiation failed (%s); steps of this shape run eagerly\n",
                 cudaGetErrorString(err));
    return nullptr;
  }
  return exec;
}

bool LaunchGraph(void* graph) {
  const cudaError_t err = cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), Stream());
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "CUDA graph launch failed (%s)\n", cudaGetErrorString(err));
    return false;
  }
  return true;
}

size_t GraphMemoryBytes() {
  BindThread();
  int device = 0;
  TGIS_CUDA_CHECK(cudaGetDevice(&device));
  unsigned long long bytes = 0;  // NOLINT(runtime/int): the attribute's type
  TGIS_CUDA_CHECK(
      cudaDeviceGetGraphMemAttribute(device, cudaGraphMemAttrReservedMemCurrent, &bytes));
  return static_cast<size_t>(bytes);
}

void DestroyGraph(void* graph) {
  if (graph != nullptr) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

}  // namespace tgis::kernels::cuda

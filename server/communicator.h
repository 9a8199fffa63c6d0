// The collectives tensor-parallel shards use to run one model together: a narrow interface with
// one implementation per transport (single process; Gloo over TCP on the CPU; NCCL on CUDA).
//
// Every rank must call the same collectives in the same order with tensors of the same shape
// (the shards do: the router sends every call to all of them and their bookkeeping is
// deterministic). A collective that fails (a peer died, a timeout) is fatal for the process:
// a shard group with a broken link cannot serve, and the launcher takes the others down.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "kernels/tensor.h"

namespace tgis::server {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // x = sum of every rank's x, in place. Contiguous, same shape everywhere; f32 on the CPU, the
  // activations' dtype (f32, bf16, f16) on CUDA.
  virtual void AllReduceSum(kernels::Tensor* x) = 0;
  // values[i] = min over ranks of values[i], in place (host integers: agreeing on sizes).
  virtual void AllReduceMin(std::span<int64_t> values) = 0;
  // out = every rank's `local` (f32, same shape everywhere) stacked in rank order:
  // [world_size, local.shape...]. An undefined `out` is allocated.
  virtual void AllGather(const kernels::Tensor& local, kernels::Tensor* out) = 0;
  // x = root's x on every rank, in place (any dtype; same shape everywhere).
  virtual void Broadcast(kernels::Tensor* x, int root) = 0;
  virtual void Barrier() = 0;
};

// World size 1: every collective is the identity.
std::shared_ptr<Communicator> MakeSingleProcessCommunicator();

}  // namespace tgis::server

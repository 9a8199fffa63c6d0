#include "server/nccl_communicator.h"

#include "absl/strings/str_cat.h"

#ifdef TGIS_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda_ops.h"
#endif

namespace tgis::server {

#ifndef TGIS_WITH_NCCL

bool NcclAvailable() { return false; }

absl::StatusOr<std::shared_ptr<Communicator>> ConnectNccl(std::shared_ptr<Communicator>) {
  return absl::UnimplementedError("this build has no NCCL (configure with CUDA)");
}

#else

namespace {

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

// A failed collective leaves the group unusable: abort, as the interface says.
void Check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::fprintf(stderr, "FATAL NCCL %s: %s\n", what, ncclGetErrorString(r));
  std::fflush(stderr);
  std::abort();
}

ncclDataType_t NcclType(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kI8:
    case DType::kF8E4M3:
      return ncclInt8;
    case DType::kU8:
      return ncclUint8;
  }
  return ncclFloat32;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> host, ncclComm_t comm)
      : host_(std::move(host)), comm_(comm) {}
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }

  void AllReduceSum(Tensor* x) override {
    if (x->device() == Device::kCpu) return host_->AllReduceSum(x);
    Check(ncclAllReduce(x->raw(), x->raw(), x->numel(), NcclType(x->dtype()), ncclSum, comm_,
                        Stream()),
          "all-reduce");
  }

  void AllReduceMin(std::span<int64_t> values) override { host_->AllReduceMin(values); }

  void AllGather(const Tensor& local, Tensor* out) override {
    if (local.device() == Device::kCpu) return host_->AllGather(local, out);
    kernels::Shape shape = local.shape();
    shape.insert(shape.begin(), world_size());
    if (!out->defined()) *out = Tensor::Empty(shape, local.dtype(), Device::kCuda);
    Check(ncclAllGather(local.raw(), out->raw(), local.numel(), NcclType(local.dtype()), comm_,
                        Stream()),
          "all-gather");
  }

  void Broadcast(Tensor* x, int root) override {
    if (x->device() == Device::kCpu) return host_->Broadcast(x, root);
    Check(
        ncclBroadcast(x->raw(), x->raw(), x->numel(), NcclType(x->dtype()), root, comm_, Stream()),
        "broadcast");
  }

  void Barrier() override {
    kernels::cuda::Synchronize();
    host_->Barrier();
  }

 private:
  static cudaStream_t Stream() { return static_cast<cudaStream_t>(kernels::cuda::NativeStream()); }

  std::shared_ptr<Communicator> host_;
  ncclComm_t comm_;
};

}  // namespace

bool NcclAvailable() { return true; }

absl::StatusOr<std::shared_ptr<Communicator>> ConnectNccl(std::shared_ptr<Communicator> host) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (host->rank() == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r)));
    }
  }
  Tensor blob = Tensor::Empty({static_cast<int64_t>(sizeof(id))}, DType::kI8);
  std::memcpy(blob.raw(), &id, sizeof(id));
  host->Broadcast(&blob, 0);
  std::memcpy(&id, blob.raw(), sizeof(id));
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = ncclCommInitRank(&comm, host->world_size(), id, host->rank());
      r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclCommInitRank (rank ", host->rank(), " of ",
                                            host->world_size(), "): ", ncclGetErrorString(r)));
  }
  return std::shared_ptr<Communicator>(std::make_shared<NcclCommunicator>(std::move(host), comm));
}

#endif  // TGIS_WITH_NCCL

}  // namespace tgis::server

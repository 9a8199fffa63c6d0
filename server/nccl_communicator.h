// Communicator over NCCL for shards on CUDA: the activations' all-reduce and the logits'
// all-gather run on the GPUs (NVLink / PCIe), queued on the kernels' stream in order with the
// forward pass. A CPU communicator (Gloo) of the same group bootstraps it (rank 0's NCCL id is
// broadcast over it) and still carries what is on the host: AllReduceMin of sizes, barriers,
// and any CPU tensor.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/communicator.h"

namespace tgis::server {

// True when this build has CUDA and NCCL; otherwise ConnectNccl fails with kUnimplemented.
bool NcclAvailable();

// Every rank of `host_group` calls this at the same time, after selecting its GPU.
absl::StatusOr<std::shared_ptr<Communicator>> ConnectNccl(std::shared_ptr<Communicator> host_group);

}  // namespace tgis::server

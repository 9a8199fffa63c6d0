// The router's view of the model shards (proto/generate.proto). With N shards every call goes
// to all of them (tensor parallel shards must run every step together) and shard 0's answer
// is the one used.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/generate.pb.h"

namespace tgis::router {

class ShardClient {
 public:
  virtual ~ShardClient() = default;
  virtual absl::StatusOr<generate::v1::InfoResponse> Info() = 0;
  virtual absl::Status Health() = 0;
  virtual absl::StatusOr<generate::v1::WarmupResponse> Warmup(
      const generate::v1::WarmupRequest& request) = 0;
  virtual absl::StatusOr<generate::v1::PrefillResponse> Prefill(
      const generate::v1::PrefillRequest& request) = 0;
  virtual absl::StatusOr<generate::v1::DecodeResponse> Decode(
      const generate::v1::DecodeRequest& request) = 0;
  virtual absl::StatusOr<generate::v1::FilterBatchResponse> FilterBatch(
      const generate::v1::FilterBatchRequest& request) = 0;
  // One cached batch, or all of them.
  virtual absl::Status ClearCache(std::optional<uint64_t> batch_id) = 0;
  // Loads a prompt-tuning prefix on every shard; its virtual-token count (shard 0's). An error
  // carries the shard's own status code and message.
  virtual absl::StatusOr<uint32_t> PrefixLookup(const std::string& prefix_id) = 0;
};

// Connects to the shards listening on unix://<uds_path>-0 .. -<num_shards - 1>, waiting until
// every one of them answers Health (they may still be loading their weights), at most
// `timeout`.
// `step_timeout` (0: none) bounds each Prefill, Decode, FilterBatch and ClearCache: a shard
// that hangs (stopped, deadlocked) fails the step with DEADLINE_EXCEEDED instead of holding
// every request until its client gives up.
absl::StatusOr<std::unique_ptr<ShardClient>> ConnectShards(
    const std::string& uds_path, int num_shards, std::chrono::seconds timeout,
    std::chrono::seconds step_timeout = std::chrono::seconds(0));

}  // namespace tgis::router

// The shard's gRPC service (proto/generate.proto) over an Engine, with the cached-batch
// bookkeeping the router relies on.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proto/generate.grpc.pb.h"
#include "server/engine.h"
#include "server/guided_decoding.h"
#include "server/model_config.h"
#include "server/prefix_store.h"
#include "server/step_ahead.h"

namespace tgis::server {

struct ShardOptions {
  std::string dtype = "float32";
  std::string device = "cpu";  // where the model runs: cpu or cuda
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> urls;  // every shard's unix socket URL
  int block_size = 16;
  // KV cache budget: explicit blocks, else this fraction of the memory available at Warmup.
  int num_blocks = 0;
  double memory_fraction = 0.3;
  // CUDA only: the share of the whole GPU this process may use (TGIS's
  // CUDA_PROCESS_MEMORY_FRACTION); the rest is left to other processes.
  double process_memory_fraction = 1.0;
  // Percent of the free memory held back from every estimate (TGIS's BATCH_SAFETY_MARGIN).
  double batch_safety_margin = 20;
  // Prompt tuning (TGIS's PREFIX_STORE_PATH, PROMPT_CACHE_SIZE_MB); no store path: off.
  std::string prefix_store_path;
  double prompt_cache_mb = 512;
  // Keys and values of full blocks kept and shared between prompts that start alike.
  bool prefix_caching = true;
  // CUDA decode steps replayed from captured graphs (Engine::EnableDecodeGraphs). On by
  // default since the H100 ran them (session 33: the same tokens as eager steps on every
  // parity fixture, batch-1 decode 6.91 -> 6.85 ms and batch 16 8.07 -> 7.80 for the 8B shape).
  bool cuda_graphs = true;
  // Each answered decode step starts the next one for the sequences certain to go on, while the
  // router handles the answer (StepAhead). The shard's --decode-ahead=auto: on CUDA only. On a
  // 2-core CPU VM the step ahead and the router fought for the cores (llama fixture, ms a token
  // through the router, off -> on: 0.75-0.85 -> 0.95); with the step on one thread, as a GPU
  // host leaves the router its own cores, 0.53-0.63 -> 0.43-0.49.
  bool decode_ahead = false;
};

class ShardService final : public generate::v1::TextGenerationService::Service {
 public:
  ShardService(ModelConfig config, std::unique_ptr<Model> model, ShardOptions options);

  grpc::Status ServiceDiscovery(grpc::ServerContext*, const generate::v1::ServiceDiscoveryRequest*,
                                generate::v1::ServiceDiscoveryResponse*) override;
  grpc::Status Info(grpc::ServerContext*, const generate::v1::InfoRequest*,
                    generate::v1::InfoResponse*) override;
  grpc::Status Health(grpc::ServerContext*, const generate::v1::HealthRequest*,
                      generate::v1::HealthResponse*) override;
  grpc::Status Warmup(grpc::ServerContext*, const generate::v1::WarmupRequest*,
                      generate::v1::WarmupResponse*) override;
  grpc::Status Prefill(grpc::ServerContext*, const generate::v1::PrefillRequest*,
                       generate::v1::PrefillResponse*) override;
  grpc::Status Decode(grpc::ServerContext*, const generate::v1::DecodeRequest*,
                      generate::v1::DecodeResponse*) override;
  grpc::Status FilterBatch(grpc::ServerContext*, const generate::v1::FilterBatchRequest*,
                           generate::v1::FilterBatchResponse*) override;
  grpc::Status ClearCache(grpc::ServerContext*, const generate::v1::ClearCacheRequest*,
                          generate::v1::ClearCacheResponse*) override;
  grpc::Status PrefixLookup(grpc::ServerContext*, const generate::v1::PrefixLookupRequest*,
                            generate::v1::PrefixLookupResponse*) override;

 private:
  grpc::Status EnsureEngine();
  // Under mu_: the engine, ready for a call, any step scheduled ahead run first.
  grpc::Status EngineForCall();
  generate::v1::CachedBatch Describe(uint64_t batch_id);
  void Release(uint64_t id);  // the engine's sequence and any token stepped ahead for it

  std::mutex mu_;  // one step at a time
  ModelConfig config_;
  // The positions the model serves (DecoderSpec::ServedPositions); 0: no limit of its own.
  int64_t max_positions_ = 0;
  bool encoder_decoder_ = false;          // the model's kind (Info, prefix lengths)
  bool can_preempt_ = false;              // Info: see KeysIndependentOfLength
  std::unique_ptr<Model> pending_model_;  // moved into the engine at Warmup
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<StepAhead> ahead_;  // after engine_: stopped before the engine goes
  ShardOptions options_;
  std::map<uint64_t, std::vector<uint64_t>> batches_;  // batch id -> request ids
  uint32_t max_prefill_tokens_ = 0;                    // sized with the KV cache
  // The most sequences a step holds (the router's max_batch_size, from Warmup): recurrent
  // models' states for that many are set aside before the KV cache is sized.
  int64_t max_sequences_ = 1;
  std::unique_ptr<PrefixStore> prefixes_;  // thread-safe itself
  GuidedAutomatonCache guided_;            // under mu_
};

}  // namespace tgis::server

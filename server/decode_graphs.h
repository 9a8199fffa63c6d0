// Decode steps on CUDA replayed from captured graphs. A step of the 8B shape launches ~260
// small kernels; their host-side launch cost, not the GPU, set the pace between the GEMVs
// (wall 9.05 ms against 7.32 ms of kernel time, measured with ncu in session 23). A graph per
// (batch, block-table width) bucket replays the whole forward pass with one launch: the step's
// ids, positions, slots and block tables go into the bucket's own device buffer (padded: extra
// rows write no cache slot and read one key), and the logits come out in the batch bucket's
// own f32 buffer.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/model.h"

namespace tgis::server {

class DecodeGraphs {
 public:
  // The largest batch replayed from a graph: bigger steps are compute-bound (and each batch
  // bucket keeps a [batch, vocabulary] f32 logits buffer).
  static constexpr int64_t kMaxBatch = 64;

  explicit DecodeGraphs(int block_size) : block_size_(block_size) {}
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  // Whether `model`'s decode steps can be replayed: on CUDA, decoder-only, one rank (NCCL
  // inside a graph is unproven here), rotary frequencies that do not depend on the lengths
  // (those are chosen on the host per step), no mixture of experts (its routing is chosen on
  // the host per layer).
  static bool Supports(const Model& model);

  // One decode step: sequence i adds token ids[i] at positions[i] into slots[i], its context
  // is context_lens[i] long and its blocks are tables[i * table_cols, + table_cols). Returns
  // the logits [S, V] f32 (a view of the bucket's buffer, valid until the next step), or an
  // undefined tensor when the step is to run eagerly (too big, or its bucket failed to
  // capture or launch).
  kernels::Tensor Step(const Model& model, std::vector<kernels::KvCacheLayer>* cache,
                       const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                       const std::vector<int32_t>& slots, const std::vector<int32_t>& context_lens,
                       const std::vector<int32_t>& tables, int64_t table_cols);

  // Captures every bucket up front, for batches up to `max_batch` (at most kMaxBatch) and
  // contexts up to `max_width` blocks: all rows padding, so no sequence is touched. At warmup,
  // before traffic: a capture records whatever is queued on the stream meanwhile, so it must
  // not race other CUDA work (a prompt-tuning prefix loaded beside a step); afterwards steps
  // outside these buckets run eagerly instead of capturing. Returns how many buckets captured.
  int CaptureAll(const Model& model, std::vector<kernels::KvCacheLayer>* cache, int64_t max_batch,
                 int64_t max_width);

  size_t graphs() const { return graphs_.size(); }
  // Device memory the graphs hold: their own allocations, logits and input buffers.
  size_t MemoryBytes() const;

 private:
  struct Graph {
    kernels::Tensor meta;  // ids, positions, slots, query_start, context_lens, tables
    void* exec = nullptr;  // null: capture failed, run eagerly
  };
  // The step's inputs as views of g's buffer.
  ForwardInput Inputs(const Graph& g, int64_t batch, int64_t width) const;
  bool Capture(const Model& model, std::vector<kernels::KvCacheLayer>* cache, int64_t batch,
               int64_t width, Graph* g);
  // The bucket's graph with `meta` (its whole buffer) copied in, captured first when new;
  // null when that bucket runs eagerly.
  Graph* Ready(const Model& model, std::vector<kernels::KvCacheLayer>* cache, int64_t batch,
               int64_t width, const std::vector<int32_t>& meta);

  int block_size_;
  bool capture_on_demand_ = true;                        // until CaptureAll
  std::map<std::pair<int64_t, int64_t>, Graph> graphs_;  // by (batch, width)
  std::map<int64_t, kernels::Tensor> logits_;            // by batch
};

}  // namespace tgis::server

#include "server/decode_graphs.h"

#include <algorithm>
#include <numeric>

#include "glog/logging.h"
#include "kernels/cuda_ops.h"

namespace tgis::server {

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

namespace {

int64_t NextPowerOfTwo(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// Offsets of the parts of a bucket's meta buffer.
struct MetaLayout {
  int64_t ids, positions, slots, query_start, context_lens, tables, total;
  MetaLayout(int64_t batch, int64_t width)
      : ids(0),
        positions(batch),
        slots(2 * batch),
        query_start(3 * batch),
        context_lens(4 * batch + 1),
        tables(5 * batch + 1),
        total(5 * batch + 1 + batch * width) {}
};

}  // namespace

DecodeGraphs::~DecodeGraphs() {
#ifdef TGIS_WITH_CUDA
  for (auto& [key, g] : graphs_) kernels::cuda::DestroyGraph(g.exec);
#endif
}

bool DecodeGraphs::Supports(const Model& model) {
#ifdef TGIS_WITH_CUDA
  return model.device() == Device::kCuda && !model.encoder_decoder() &&
         model.shard().world_size == 1 && !model.spec().rope_by_length.has_value() &&
         model.spec().num_experts == 0 &&              // the router's scores cross to the host
         model.spec().RecurrentStateShapes().empty();  // per-sequence states, not in a graph
#else
  (void)model;
  return false;
#endif
}

ForwardInput DecodeGraphs::Inputs(const Graph& g, int64_t batch, int64_t width) const {
  const MetaLayout at(batch, width);
  ForwardInput in;
  in.input_ids = g.meta.Rows(at.ids, at.ids + batch);
  in.positions = g.meta.Rows(at.positions, at.positions + batch);
  in.slot_mapping = g.meta.Rows(at.slots, at.slots + batch);
  in.attn.query_start = g.meta.Rows(at.query_start, at.query_start + batch + 1);
  in.attn.context_lens = g.meta.Rows(at.context_lens, at.context_lens + batch);
  in.attn.block_tables = g.meta.Rows(at.tables, at.tables + batch * width).Reshape({batch, width});
  in.attn.block_size = block_size_;
  // Launch sizes for the longest context the bucket holds, whatever this step's is. (The host
  // copies of the batch stay empty: Supports leaves out the models that read them.)
  in.attn.max_context_len = width * block_size_;
  return in;
}

bool DecodeGraphs::Capture(const Model& model, std::vector<kernels::KvCacheLayer>* cache,
                           int64_t batch, int64_t width, Graph* g) {
#ifdef TGIS_WITH_CUDA
  ForwardInput in = Inputs(*g, batch, width);
  std::vector<int32_t> rows(batch);
  std::iota(rows.begin(), rows.end(), 0);
  Tensor& logits = logits_[batch];
  // One eager pass first: first-use work (cuBLASLt's heuristics and workspace) happens outside
  // the recording, and the step's keys and values are written as the replay writes them.
  {
    const Tensor eager = model.Logits(model.ForwardHidden(in, cache, rows));
    if (!logits.defined()) logits = Tensor::Empty(eager.shape(), DType::kF32, Device::kCuda);
  }
  kernels::cuda::BeginCapture();
  {
    // Everything allocated in here is freed in here too: the graph's own memory.
    const Tensor out = model.Logits(model.ForwardHidden(in, cache, rows));
    kernels::cuda::Copy(logits.raw(), Device::kCuda, out.raw(), Device::kCuda, out.nbytes());
  }
  g->exec = kernels::cuda::EndCapture();
  if (g->exec == nullptr) {
    LOG(WARNING) << "decode graph for batch " << batch << ", " << width * block_size_
                 << " tokens of context: not captured; those steps run eagerly";
  }
  return g->exec != nullptr;
#else
  (void)model, (void)cache, (void)batch, (void)width, (void)g;
  return false;
#endif
}

DecodeGraphs::Graph* DecodeGraphs::Ready(const Model& model,
                                         std::vector<kernels::KvCacheLayer>* cache, int64_t batch,
                                         int64_t width, const std::vector<int32_t>& meta) {
#ifdef TGIS_WITH_CUDA
  if (!capture_on_demand_ && graphs_.count({batch, width}) == 0) return nullptr;
  auto [it, fresh] = graphs_.try_emplace({batch, width});
  Graph& g = it->second;
  if (!fresh && g.exec == nullptr) return nullptr;  // its capture failed: eager, no copy
  if (fresh)
    g.meta = Tensor::Empty({static_cast<int64_t>(meta.size())}, DType::kI32, Device::kCuda);
  kernels::cuda::Copy(g.meta.raw(), Device::kCuda, meta.data(), Device::kCpu,
                      meta.size() * sizeof(int32_t));
  if (fresh) Capture(model, cache, batch, width, &g);
  return g.exec != nullptr ? &g : nullptr;
#else
  (void)model, (void)cache, (void)batch, (void)width, (void)meta;
  return nullptr;
#endif
}

namespace {

// A bucket's meta buffer with the step's rows first and padding after: token 0 at position 0,
// no cache slot, one key (block 0's first).
std::vector<int32_t> PaddedMeta(int64_t batch, int64_t width, const std::vector<int32_t>& ids,
                                const std::vector<int32_t>& positions,
                                const std::vector<int32_t>& slots,
                                const std::vector<int32_t>& context_lens,
                                const std::vector<int32_t>& tables, int64_t table_cols) {
  const MetaLayout at(batch, width);
  std::vector<int32_t> meta(at.total, 0);
  std::copy(ids.begin(), ids.end(), meta.begin() + at.ids);
  std::copy(positions.begin(), positions.end(), meta.begin() + at.positions);
  std::fill(meta.begin() + at.slots, meta.begin() + at.slots + batch, -1);
  std::copy(slots.begin(), slots.end(), meta.begin() + at.slots);
  std::iota(meta.begin() + at.query_start, meta.begin() + at.query_start + batch + 1, 0);
  std::fill(meta.begin() + at.context_lens, meta.begin() + at.context_lens + batch, 1);
  std::copy(context_lens.begin(), context_lens.end(), meta.begin() + at.context_lens);
  for (size_t i = 0; i < ids.size(); ++i) {
    std::copy(tables.begin() + i * table_cols, tables.begin() + (i + 1) * table_cols,
              meta.begin() + at.tables + i * width);
  }
  return meta;
}

}  // namespace

size_t DecodeGraphs::MemoryBytes() const {
#ifdef TGIS_WITH_CUDA
  size_t bytes = kernels::cuda::GraphMemoryBytes();
  for (const auto& [batch, logits] : logits_) bytes += logits.nbytes();
  for (const auto& [key, g] : graphs_) bytes += g.meta.nbytes();
  return bytes;
#else
  return 0;
#endif
}

int DecodeGraphs::CaptureAll(const Model& model, std::vector<kernels::KvCacheLayer>* cache,
                             int64_t max_batch, int64_t max_width) {
  const std::vector<int32_t> none;
  int captured = 0;
  const int64_t batches = NextPowerOfTwo(std::min(max_batch, kMaxBatch));
  for (int64_t batch = 1; batch <= batches; batch *= 2) {
    for (int64_t width = 1;; width *= 2) {
      const std::vector<int32_t> meta = PaddedMeta(batch, width, none, none, none, none, none, 0);
      if (Ready(model, cache, batch, width, meta) != nullptr) ++captured;
      if (width >= max_width) break;
    }
  }
  capture_on_demand_ = false;
  return captured;
}

Tensor DecodeGraphs::Step(const Model& model, std::vector<kernels::KvCacheLayer>* cache,
                          const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                          const std::vector<int32_t>& slots,
                          const std::vector<int32_t>& context_lens,
                          const std::vector<int32_t>& tables, int64_t table_cols) {
#ifdef TGIS_WITH_CUDA
  const int64_t nseq = static_cast<int64_t>(ids.size());
  if (nseq == 0 || nseq > kMaxBatch) return Tensor();
  const int64_t batch = NextPowerOfTwo(nseq), width = NextPowerOfTwo(table_cols);
  Graph* g =
      Ready(model, cache, batch, width,
            PaddedMeta(batch, width, ids, positions, slots, context_lens, tables, table_cols));
  if (g == nullptr || !kernels::cuda::LaunchGraph(g->exec)) return Tensor();
  return logits_[batch].Rows(0, nseq);
#else
  (void)model, (void)cache, (void)ids, (void)positions, (void)slots, (void)context_lens;
  (void)tables, (void)table_cols;
  return Tensor();
#endif
}

}  // namespace tgis::server

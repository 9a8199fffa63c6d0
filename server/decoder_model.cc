#include "server/decoder_model.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

namespace {

// Copies rows of a [T, C] f32 tensor into a new [rows, C] tensor.
Tensor GatherRows(const Tensor& x, const std::vector<int32_t>& rows) {
  const int64_t c = x.dim(1);
  Tensor out = Tensor::Empty({static_cast<int64_t>(rows.size()), c}, DType::kF32);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.data<float>() + i * c, x.data<float>() + rows[i] * c, c * sizeof(float));
  }
  return out;
}

// Splits fused qkv [T, (Hq + 2Hk) D] into q [T, Hq, D], k [T, Hk, D], v [T, Hk, D].
void SplitQkv(const Tensor& qkv, int64_t hq, int64_t hk, int64_t d, Tensor* q, Tensor* k,
              Tensor* v) {
  const int64_t t = qkv.dim(0);
  const int64_t width = (hq + 2 * hk) * d;
  *q = Tensor::Empty({t, hq, d}, DType::kF32);
  *k = Tensor::Empty({t, hk, d}, DType::kF32);
  *v = Tensor::Empty({t, hk, d}, DType::kF32);
  for (int64_t i = 0; i < t; ++i) {
    const float* row = qkv.data<float>() + i * width;
    std::memcpy(q->data<float>() + i * hq * d, row, hq * d * sizeof(float));
    std::memcpy(k->data<float>() + i * hk * d, row + hq * d, hk * d * sizeof(float));
    std::memcpy(v->data<float>() + i * hk * d, row + (hq + hk) * d, hk * d * sizeof(float));
  }
}

absl::Status CheckShape(const Tensor& t, const kernels::Shape& want, const std::string& what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(what, ": missing"));
  if (t.shape() != want) {
    std::string got, exp;
    for (auto d : t.shape()) absl::StrAppend(&got, got.empty() ? "" : ",", d);
    for (auto d : want) absl::StrAppend(&exp, exp.empty() ? "" : ",", d);
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", got, "], expected [", exp, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShardLayout> ShardLayout::Make(const DecoderSpec& s, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not in [0, world size ", world, ")"));
  }
  auto indivisible = [&](const char* what, int64_t n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor parallel: ", what, " (", n, ") is not divisible by the world size (", world, ")"));
  };
  if (s.num_heads % world != 0) return indivisible("the number of attention heads", s.num_heads);
  if (s.intermediate % world != 0) return indivisible("the MLP size", s.intermediate);
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError("attention heads are not a multiple of the KV heads");
  }
  if (s.vocab < world) return indivisible("the vocabulary", s.vocab);
  ShardLayout l;
  l.rank = rank;
  l.world_size = world;
  const int64_t hq = s.num_heads / world;
  l.q_heads = {rank * hq, (rank + 1) * hq};
  if (s.num_kv_heads >= world) {
    if (s.num_kv_heads % world != 0) return indivisible("the number of KV heads", s.num_kv_heads);
    const int64_t hk = s.num_kv_heads / world;
    l.kv_heads = {rank * hk, (rank + 1) * hk};
  } else {
    // Fewer KV heads than ranks: each rank keeps the one its q heads share (a rank's q heads
    // must not straddle two KV heads' groups).
    if (world % s.num_kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor parallel: the world size (", world,
                                                     ") is not a multiple of the KV heads (",
                                                     s.num_kv_heads, ")"));
    }
    const int64_t kv = rank * s.num_kv_heads / world;
    l.kv_heads = {kv, kv + 1};
    l.kv_replicated = world > 1;
  }
  const int64_t inter = s.intermediate / world;
  l.intermediate = {rank * inter, (rank + 1) * inter};
  l.vocab_chunk = (s.vocab + world - 1) / world;
  l.vocab = {std::min(s.vocab, rank * l.vocab_chunk),
             std::min(s.vocab, (rank + 1) * l.vocab_chunk)};
  return l;
}

absl::Status ValidateWeights(const DecoderSpec& s, const ShardLayout& layout,
                             const DecoderWeights& w) {
  const int64_t hq = layout.q_heads.size(), hk = layout.kv_heads.size();
  const int64_t inter = layout.intermediate.size(), vocab = layout.vocab.size();
  const int64_t qkv = (hq + 2 * hk) * s.head_dim;
  const int64_t up = s.mlp == MlpKind::kGatedSilu ? 2 * inter : inter;
  if (auto st = CheckShape(w.embed, {vocab, s.hidden}, "embedding"); !st.ok()) return st;
  if (auto st = CheckShape(w.lm_head, {vocab, s.hidden}, "lm_head"); !st.ok()) return st;
  if (static_cast<int64_t>(w.layers.size()) != s.num_layers) {
    return absl::InvalidArgumentError("layer count does not match the config");
  }
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layer ", i, " ");
    for (auto [t, shape, name] :
         {std::tuple{&l.qkv_w, kernels::Shape{qkv, s.hidden}, "qkv"},
          std::tuple{&l.o_w, kernels::Shape{s.hidden, hq * s.head_dim}, "o_proj"},
          std::tuple{&l.up_w, kernels::Shape{up, s.hidden}, "mlp up"},
          std::tuple{&l.down_w, kernels::Shape{s.hidden, inter}, "mlp down"},
          std::tuple{&l.ln1_w, kernels::Shape{s.hidden}, "input norm"},
          std::tuple{&l.ln2_w, kernels::Shape{s.hidden}, "post-attention norm"}}) {
      if (auto st = CheckShape(*t, shape, p + name); !st.ok()) return st;
    }
    for (auto [t, shape, name] :
         {std::tuple{&l.qkv_b, kernels::Shape{qkv}, "qkv bias"},
          std::tuple{&l.o_b, kernels::Shape{s.hidden}, "o_proj bias"},
          std::tuple{&l.up_b, kernels::Shape{up}, "mlp up bias"},
          std::tuple{&l.down_b, kernels::Shape{s.hidden}, "mlp down bias"}}) {
      if (!t->defined()) continue;
      if (auto st = CheckShape(*t, shape, p + name); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

CausalLM::CausalLM(DecoderSpec spec, DecoderWeights weights, std::shared_ptr<Communicator> comm)
    : spec_(std::move(spec)),
      w_(std::move(weights)),
      comm_(comm ? std::move(comm) : MakeSingleProcessCommunicator()) {
  auto layout = ShardLayout::Make(spec_, comm_->rank(), comm_->world_size());
  if (!layout.ok()) {  // builders check this (and report it) before they slice the weights
    std::fprintf(stderr, "FATAL CausalLM: %s\n", std::string(layout.status().message()).c_str());
    std::abort();
  }
  layout_ = *layout;
  if (spec_.attn_scale == 0) {
    spec_.attn_scale = 1.0f / std::sqrt(static_cast<float>(spec_.head_dim));
  }
  if (spec_.position == PositionKind::kAlibi) {
    const std::vector<float> all = kernels::AlibiSlopes(static_cast<int>(spec_.num_heads));
    alibi_.assign(all.begin() + layout_.q_heads.begin, all.begin() + layout_.q_heads.end);
  }
}

size_t CausalLM::KvBytesPerToken() const {
  return static_cast<size_t>(2 * spec_.num_layers * layout_.kv_heads.size() * spec_.head_dim) *
         sizeof(float);
}

void CausalLM::Embed(const Tensor& ids, Tensor* x) const {
  if (layout_.world_size == 1) {
    kernels::Embedding(ids, w_.embed, x);
    return;
  }
  // Vocab-parallel: this rank looks up the ids in its slice; the others' rows are zero, so the
  // sum over ranks is the embedding.
  const int64_t t = ids.numel(), h = spec_.hidden;
  std::vector<int32_t> local(t, 0);
  std::vector<bool> mine(t, false);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t id = ids.dtype() == DType::kI64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
    mine[i] = layout_.vocab.begin <= id && id < layout_.vocab.end;
    if (mine[i]) local[i] = static_cast<int32_t>(id - layout_.vocab.begin);
  }
  if (layout_.vocab.size() > 0) {
    kernels::Embedding(Tensor::FromVector(local, {t}), w_.embed, x);
  } else {
    std::memset(x->raw(), 0, x->nbytes());
  }
  for (int64_t i = 0; i < t; ++i) {
    if (!mine[i]) std::memset(x->data<float>() + i * h, 0, h * sizeof(float));
  }
  comm_->AllReduceSum(x);
}

Tensor CausalLM::LmHead(const Tensor& normed) const {
  const int64_t rows = normed.dim(0);
  Tensor local = Tensor::Empty({rows, layout_.vocab.size()}, DType::kF32);
  kernels::Linear(normed, w_.lm_head, nullptr, &local);
  if (layout_.world_size == 1) return local;
  // Vocab-parallel: every rank computes its slice of the logits; the all-gather (equal chunks:
  // the last rank's is padded) gives every rank all of them, so they all sample alike.
  const int64_t chunk = layout_.vocab_chunk, world = layout_.world_size;
  Tensor padded = local;
  if (layout_.vocab.size() != chunk) {
    padded = Tensor::Zeros({rows, chunk}, DType::kF32);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(padded.data<float>() + r * chunk, local.data<float>() + r * local.dim(1),
                  local.dim(1) * sizeof(float));
    }
  }
  Tensor gathered;  // [world, rows, chunk]
  comm_->AllGather(padded, &gathered);
  Tensor logits = Tensor::Empty({rows, spec_.vocab}, DType::kF32);
  for (int64_t k = 0; k < world; ++k) {
    const int64_t begin = std::min(spec_.vocab, k * chunk);
    const int64_t n = std::min(spec_.vocab, (k + 1) * chunk) - begin;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(logits.data<float>() + r * spec_.vocab + begin,
                  gathered.data<float>() + (k * rows + r) * chunk, n * sizeof(float));
    }
  }
  return logits;
}

void CausalLM::Norm(const Tensor& x, const Tensor& w, const Tensor& b, Tensor* out) const {
  if (spec_.norm == NormKind::kRms) {
    kernels::RmsNorm(x, w, spec_.norm_eps, out);
  } else {
    kernels::LayerNorm(x, w, b.defined() ? &b : nullptr, spec_.norm_eps, out);
  }
}

// This rank's part of the MLP output (before the all-reduce).
void CausalLM::Mlp(const LayerWeights& w, const Tensor& x, Tensor* out) const {
  const int64_t t = x.dim(0);
  const int64_t inter = layout_.intermediate.size();
  if (spec_.mlp == MlpKind::kGatedSilu) {
    Tensor gate_up = Tensor::Empty({t, 2 * inter}, DType::kF32);
    kernels::Linear(x, w.up_w, w.up_b.defined() ? &w.up_b : nullptr, &gate_up);
    Tensor act = Tensor::Empty({t, inter}, DType::kF32);
    kernels::SiluMul(gate_up, &act);
    kernels::Linear(act, w.down_w, RowParallelBias(w.down_b), out);
  } else {
    Tensor h = Tensor::Empty({t, inter}, DType::kF32);
    kernels::Linear(x, w.up_w, w.up_b.defined() ? &w.up_b : nullptr, &h);
    kernels::Gelu(spec_.gelu, &h);
    kernels::Linear(h, w.down_w, RowParallelBias(w.down_b), out);
  }
}

Tensor CausalLM::Forward(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                         const std::vector<int32_t>& logit_rows) const {
  const DecoderSpec& s = spec_;
  const int64_t t = in.input_ids.dim(0);
  const int64_t hq = layout_.q_heads.size(), hk = layout_.kv_heads.size();
  const bool parallel = layout_.world_size > 1;
  Tensor x = Tensor::Empty({t, s.hidden}, DType::kF32);
  Embed(in.input_ids, &x);
  if (s.position == PositionKind::kLearned) {
    Tensor pos = Tensor::Empty({t, s.hidden}, DType::kF32);
    kernels::Embedding(in.positions, w_.pos_embed, &pos);
    kernels::AddInPlace(&x, pos);
  }
  Tensor h = Tensor::Empty({t, s.hidden}, DType::kF32);
  Tensor qkv = Tensor::Empty({t, (hq + 2 * hk) * s.head_dim}, DType::kF32);
  Tensor attn = Tensor::Empty({t, hq, s.head_dim}, DType::kF32);
  Tensor o = Tensor::Empty({t, s.hidden}, DType::kF32);
  Tensor m = Tensor::Empty({t, s.hidden}, DType::kF32);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const LayerWeights& w = w_.layers[l];
    Norm(x, w.ln1_w, w.ln1_b, &h);
    kernels::Linear(h, w.qkv_w, w.qkv_b.defined() ? &w.qkv_b : nullptr, &qkv);
    Tensor q, k, v;
    SplitQkv(qkv, hq, hk, s.head_dim, &q, &k, &v);
    if (s.position == PositionKind::kRotary) kernels::Rotary(s.rotary, in.positions, &q, &k);
    kernels::ReshapeAndCache(k, v, in.slot_mapping, &(*cache)[l]);
    kernels::PagedAttention(q, (*cache)[l], in.attn, s.attn_scale, s.sliding_window,
                            alibi_.empty() ? nullptr : &alibi_, &attn);
    kernels::Linear(attn.Reshape({t, hq * s.head_dim}), w.o_w, RowParallelBias(w.o_b), &o);
    if (s.parallel_residual) {
      Norm(x, w.ln2_w, w.ln2_b, &h);
      Mlp(w, h, &m);
      if (parallel) {
        // x + attn + mlp: one all-reduce of this rank's attn + mlp parts.
        kernels::AddInPlace(&o, m);
        comm_->AllReduceSum(&o);
        kernels::AddInPlace(&x, o);
      } else {
        kernels::AddInPlace(&x, o);
        kernels::AddInPlace(&x, m);
      }
    } else {
      comm_->AllReduceSum(&o);
      kernels::AddInPlace(&x, o);
      Norm(x, w.ln2_w, w.ln2_b, &h);
      Mlp(w, h, &m);
      comm_->AllReduceSum(&m);
      kernels::AddInPlace(&x, m);
    }
  }
  Tensor last = GatherRows(x, logit_rows);
  Tensor normed = Tensor::Empty(last.shape(), DType::kF32);
  Norm(last, w_.final_norm_w, w_.final_norm_b, &normed);
  return LmHead(normed);
}

}  // namespace tgis::server

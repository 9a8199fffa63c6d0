#include "server/decoder_model.h"

#include <algorithm>
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
  if (s.shared_expert_intermediate % world != 0) {
    return indivisible("the shared expert's MLP size", s.shared_expert_intermediate);
  }
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
  const int64_t shared = s.shared_expert_intermediate / world;
  l.shared_expert = {rank * shared, (rank + 1) * shared};
  l.mamba = s.mamba;
  if (!s.mamba_layers.empty()) {
    const int64_t heads = s.mamba.ssm.heads, groups = s.mamba.ssm.groups;
    if (heads % world != 0) return indivisible("the number of Mamba-2 heads", heads);
    if (groups <= 0 || heads % groups != 0) {
      return absl::InvalidArgumentError("Mamba-2 heads are not a multiple of the groups");
    }
    if (groups % world != 0 && world % groups != 0) {
      // A rank's heads would read parts of two groups.
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallel: the number of Mamba-2 groups (", groups,
                       ") and the world size (", world, "): neither divides the other"));
    }
    const int64_t mine = heads / world;
    l.mamba_heads = {rank * mine, (rank + 1) * mine};
    if (groups % world == 0) {
      const int64_t g = groups / world;
      l.mamba_groups = {rank * g, (rank + 1) * g};
    } else {
      const int64_t g = rank * groups / world;
      l.mamba_groups = {g, g + 1};
    }
    l.mamba.ssm.heads = l.mamba_heads.size();
    l.mamba.ssm.groups = l.mamba_groups.size();
  }
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
  const int64_t up = s.mlp == MlpKind::kGated ? 2 * inter : inter;
  if (s.qk_norms && s.qk_norms_whole && layout.kv_replicated) {
    // The k norm spans every KV head once; ranks that share a KV head would count it twice.
    return absl::UnimplementedError(absl::StrCat(
        "a k norm over all KV heads (OLMo 2) with tensor parallelism over more ranks (",
        layout.world_size, ") than KV heads (", s.num_kv_heads, ") is not supported"));
  }
  const int64_t e = s.EmbedDim();
  if (auto st = CheckShape(w.embed, {vocab, e}, "embedding"); !st.ok()) return st;
  if (auto st = CheckShape(w.lm_head, {vocab, e}, "lm_head"); !st.ok()) return st;
  if (w.lm_head_b.defined()) {
    if (auto st = CheckShape(w.lm_head_b, {vocab}, "lm_head bias"); !st.ok()) return st;
  }
  if (e != s.hidden) {
    if (auto st = CheckShape(w.project_in, {s.hidden, e}, "project_in"); !st.ok()) return st;
    if (auto st = CheckShape(w.project_out, {e, s.hidden}, "project_out"); !st.ok()) return st;
  }
  if (s.embed_norm) {
    if (auto st = CheckShape(w.embed_norm_w, {s.hidden}, "embedding norm"); !st.ok()) return st;
  }
  if (w.final_norm_w.defined()) {
    if (auto st = CheckShape(w.final_norm_w, {s.hidden}, "final norm"); !st.ok()) return st;
  } else if (s.residual != Residual::kPostNorm) {
    return absl::InvalidArgumentError("final norm: missing");
  }
  if (s.position == PositionKind::kLearned &&
      (!w.pos_embed.defined() || w.pos_embed.rank() != 2 || w.pos_embed.dim(1) != s.hidden)) {
    return absl::InvalidArgumentError("learned position embeddings: missing or not [P, hidden]");
  }
  if (s.position == PositionKind::kAlibi && !s.alibi_slopes.empty() &&
      static_cast<int64_t>(s.alibi_slopes.size()) != s.num_heads) {
    return absl::InvalidArgumentError("ALiBi: one slope per attention head is needed");
  }
  if (static_cast<int64_t>(w.layers.size()) != s.num_layers) {
    return absl::InvalidArgumentError("layer count does not match the config");
  }
  if (!s.layer_windows.empty() && static_cast<int64_t>(s.layer_windows.size()) != s.num_layers) {
    return absl::InvalidArgumentError("per-layer sliding windows: one per layer is needed");
  }
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layer ", i, " ");
    std::vector<std::tuple<const Tensor*, kernels::Shape, std::string>> want;
    if (s.IsMamba(i)) {
      const MambaSpec& m = layout.mamba;  // this rank's heads and groups
      const int64_t c = m.conv_channels(), heads = m.ssm.heads;
      want = {{&l.mamba_in_w, {m.projection(), s.hidden}, "mamba in_proj"},
              {&l.conv_w, {c, m.ssm.conv_kernel}, "mamba conv1d"},
              {&l.dt_bias, {heads}, "mamba dt_bias"},
              {&l.a_log, {heads}, "mamba A_log"},
              {&l.ssm_d, {heads}, "mamba D"},
              {&l.mamba_norm_w, {s.mamba.inner()}, "mamba norm"},  // whole: see MambaMixer
              {&l.mamba_out_w, {s.hidden, m.inner()}, "mamba out_proj"}};
      if (m.conv_bias) want.emplace_back(&l.conv_b, kernels::Shape{c}, "mamba conv1d bias");
      if (m.proj_bias) {
        want.emplace_back(&l.mamba_in_b, kernels::Shape{m.projection()}, "mamba in_proj bias");
        want.emplace_back(&l.mamba_out_b, kernels::Shape{s.hidden}, "mamba out_proj bias");
      }
    } else {
      want = {{&l.qkv_w, {qkv, s.hidden}, "qkv"}, {&l.o_w, {s.hidden, hq * s.head_dim}, "o_proj"}};
    }
    if (s.residual != Residual::kOutputNorms) {
      want.emplace_back(&l.ln1_w, kernels::Shape{s.hidden}, "input norm");
      want.emplace_back(&l.ln2_w, kernels::Shape{s.hidden},
                        s.residual == Residual::kSandwich ? "pre-MLP norm" : "post-attention norm");
    }
    if (s.num_experts > 0) {
      if (static_cast<int64_t>(l.expert_up.size()) != s.num_experts ||
          static_cast<int64_t>(l.expert_down.size()) != s.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat(p, "experts: ", s.num_experts, " expected"));
      }
      const int64_t shared = layout.shared_expert.size();
      const bool gate_row = shared > 0 && s.shared_expert_gated;
      want.emplace_back(&l.router_w, kernels::Shape{s.num_experts + (gate_row ? 1 : 0), s.hidden},
                        "router");
      if (shared > 0) {
        want.emplace_back(&l.shared_up, kernels::Shape{2 * shared, s.hidden}, "shared expert up");
        want.emplace_back(&l.shared_down, kernels::Shape{s.hidden, shared}, "shared expert down");
      }
      for (int64_t e = 0; e < s.num_experts; ++e) {
        want.emplace_back(&l.expert_up[e], kernels::Shape{up, s.hidden},
                          absl::StrCat("expert ", e, " up"));
        want.emplace_back(&l.expert_down[e], kernels::Shape{s.hidden, inter},
                          absl::StrCat("expert ", e, " down"));
      }
    } else {
      want.emplace_back(&l.up_w, kernels::Shape{up, s.hidden}, "mlp up");
      want.emplace_back(&l.down_w, kernels::Shape{s.hidden, inter}, "mlp down");
    }
    if (s.residual == Residual::kSandwich || s.residual == Residual::kOutputNorms) {
      want.emplace_back(&l.post_attn_norm_w, kernels::Shape{s.hidden}, "post-attention norm");
      want.emplace_back(&l.post_mlp_norm_w, kernels::Shape{s.hidden}, "post-MLP norm");
    }
    if (s.qk_norms) {
      const bool whole = s.qk_norms_whole;
      want.emplace_back(&l.q_norm_w, kernels::Shape{whole ? s.num_heads * s.head_dim : s.head_dim},
                        "q norm");
      want.emplace_back(&l.k_norm_w,
                        kernels::Shape{whole ? s.num_kv_heads * s.head_dim : s.head_dim}, "k norm");
    }
    for (const auto& [t, shape, name] : want) {
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
  // The mixers and their states (RecurrentStateShapes) are this rank's heads and groups.
  spec_.mamba = layout_.mamba;
  if (spec_.attn_scale == 0) {
    spec_.attn_scale = 1.0f / std::sqrt(static_cast<float>(spec_.head_dim));
  }
  if (spec_.position == PositionKind::kAlibi) {
    const std::vector<float> all = spec_.alibi_slopes.empty()
                                       ? kernels::AlibiSlopes(static_cast<int>(spec_.num_heads))
                                       : spec_.alibi_slopes;
    attn_bias_.alibi_slopes.assign(all.begin() + layout_.q_heads.begin,
                                   all.begin() + layout_.q_heads.end);
  }
  attn_bias_.softcap = spec_.attn_softcap;
  attn_bias_used_ = !attn_bias_.alibi_slopes.empty() || attn_bias_.softcap > 0;
  if (std::any_of(w_.layers.begin(), w_.layers.end(),
                  [](const LayerWeights& l) { return !l.attn_sinks.empty(); })) {
    layer_attn_bias_.assign(w_.layers.size(), attn_bias_);
    for (size_t l = 0; l < w_.layers.size(); ++l)
      layer_attn_bias_[l].sinks = w_.layers[l].attn_sinks;
  }
}

const kernels::AttentionBias* CausalLM::AttentionBiasOf(int64_t layer) const {
  const size_t l = static_cast<size_t>(layer);
  if (l < layer_attn_bias_.size() && !layer_attn_bias_[l].sinks.empty()) {
    return &layer_attn_bias_[l];
  }
  return attn_bias_used_ ? &attn_bias_ : nullptr;
}

size_t CausalLM::KvBytesPerToken() const {
  // Mamba-2 layers keep no keys or values (their per-sequence states are apart).
  const auto mamba = std::count(spec_.mamba_layers.begin(), spec_.mamba_layers.end(), true);
  const int64_t layers = spec_.num_layers - static_cast<int64_t>(mamba);
  return static_cast<size_t>(2 * layers * layout_.kv_heads.size() * spec_.head_dim) *
         kernels::DTypeSize(kv_dtype());
}

kernels::DType CausalLM::kv_dtype() const {
  std::vector<const Tensor*> linears;
  for (const LayerWeights& l : w_.layers) {
    for (const Tensor* t : l.Linears()) linears.push_back(t);
  }
  return KvCacheDType(device_, act_dtype_, linears);
}

void CausalLM::MoveTo(kernels::Device device) {
  if (device == device_) {
    if (device == kernels::Device::kCpu) {
      kernels::PrepareCpuWeight(&w_.lm_head);
      kernels::PrepareCpuWeight(&w_.project_in);
      kernels::PrepareCpuWeight(&w_.project_out);
      for (LayerWeights& l : w_.layers) {
        for (Tensor* t : l.Linears()) kernels::PrepareCpuWeight(t);
      }
    }
    return;
  }
  // The activations take the linear weights' dtype; small tensors (norms, biases, loaded f32)
  // follow, since the CUDA kernels want one dtype per op.
  // Quantized linears: the embedding's dtype.
  const DType dtype = w_.layers.empty() || w_.layers[0].qkv_w.quantized()
                          ? w_.embed.dtype()
                          : w_.layers[0].qkv_w.dtype();
  auto move = [&](Tensor* t) { MoveWeight(t, dtype, device); };
  const bool tied = w_.lm_head.raw() == w_.embed.raw();
  move(&w_.embed);
  if (tied) {
    w_.lm_head = w_.embed;
  } else {
    move(&w_.lm_head);
  }
  move(&w_.lm_head_b);
  move(&w_.pos_embed);
  move(&w_.embed_norm_w);
  move(&w_.embed_norm_b);
  move(&w_.project_in);
  move(&w_.project_out);
  move(&w_.final_norm_w);
  move(&w_.final_norm_b);
  for (LayerWeights& l : w_.layers) {
    for (Tensor* t :
         {&l.ln1_w, &l.ln1_b, &l.ln2_w, &l.ln2_b, &l.post_attn_norm_w, &l.post_attn_norm_b,
          &l.post_mlp_norm_w, &l.post_mlp_norm_b, &l.q_norm_w, &l.q_norm_b, &l.k_norm_w,
          &l.k_norm_b, &l.qkv_b, &l.o_b, &l.up_b, &l.down_b, &l.router_w, &l.router_b}) {
      move(t);
    }
    for (auto* biases : {&l.expert_up_b, &l.expert_down_b}) {
      for (Tensor& t : *biases) move(&t);
    }
    for (Tensor* t : {&l.mamba_in_b, &l.mamba_out_b, &l.mamba_norm_w}) move(t);
    // The selective scan's parameters stay f32 (its recurrence runs in f32).
    for (Tensor* t : {&l.conv_w, &l.conv_b, &l.dt_bias, &l.a_log, &l.ssm_d}) {
      MoveWeight(t, DType::kF32, device);
    }
    for (Tensor* t : l.Linears()) move(t);
  }
  device_ = device;
  act_dtype_ = dtype;
}

Tensor CausalLM::Buf(const kernels::Shape& shape) const {
  return Tensor::Empty(shape, act_dtype_, device_);
}

Tensor SelectRows(const Tensor& x, const std::vector<int32_t>& rows) {
  bool every_row = static_cast<int64_t>(rows.size()) == x.dim(0);
  for (size_t i = 0; every_row && i < rows.size(); ++i) {
    every_row = rows[i] == static_cast<int32_t>(i);
  }
  if (every_row) return x;
  Tensor idx = Tensor::FromVector(rows, {static_cast<int64_t>(rows.size())});
  if (x.device() != kernels::Device::kCpu) idx = idx.ToDevice(x.device());
  Tensor out;
  kernels::Embedding(idx, x, &out);  // a row gather
  return out;
}

void MoveWeight(Tensor* t, DType dtype, kernels::Device device) {
  if (!t->defined()) return;
  if (t->quantized()) {  // stays quantized; CUDA dequantizes to the activations' dtype
    *t = t->ToDevice(device);
    return;
  }
  Tensor host = t->dtype() == dtype ? *t : t->To(dtype);
  *t = host.ToDevice(device);
}

DType KvCacheDType(kernels::Device device, DType act, const std::vector<const Tensor*>& linears) {
  if (device != kernels::Device::kCpu) return act;
  std::optional<DType> dense;
  for (const Tensor* t : linears) {
    if (!t->defined()) continue;
    if (t->quantized()) return act;
    dense = dense.value_or(t->dtype());
  }
  return dense == DType::kBF16 || dense == DType::kF16 ? *dense : act;
}

void MixPrefixRows(const ForwardInput& in, Tensor* x) {
  if (!in.prefix_values.defined()) return;
  // Virtual tokens: their rows come from the prefix instead (a row gather over both).
  const int64_t t = x->dim(0), e = x->dim(1), r = in.prefix_values.dim(0);
  Tensor table = Tensor::Empty({t + r, e}, x->dtype(), x->device());
  Tensor tokens = table.Rows(0, t), virtual_tokens = table.Rows(t, t + r);
  kernels::CopyColumns(*x, 0, e, &tokens, 0);
  kernels::CopyColumns(in.prefix_values, 0, e, &virtual_tokens, 0);
  kernels::Embedding(in.embedding_source, table, x);
}

void EmbedTokens(const Tensor& ids, const Tensor& embed, const ShardLayout& layout,
                 Communicator& comm, Tensor* x) {
  if (layout.world_size == 1) {
    kernels::Embedding(ids, embed, x);
    return;
  }
  // Vocab-parallel: this rank looks up the ids in its slice and leaves zeros for the others';
  // the sum over ranks is the embedding.
  kernels::EmbeddingSlice(ids, embed, layout.vocab.begin, x);
  comm.AllReduceSum(x);
}

Tensor VocabLogits(const Tensor& normed, const Tensor& lm_head, const Tensor* lm_head_b,
                   const ShardLayout& layout, int64_t vocab, Communicator& comm) {
  const int64_t rows = normed.dim(0);
  const kernels::Device device = normed.device();
  // f32 logits whatever the activations: sampling and logprobs want them unrounded.
  Tensor local = Tensor::Empty({rows, layout.vocab.size()}, DType::kF32, device);
  kernels::Linear(normed, lm_head, lm_head_b, &local);
  if (layout.world_size == 1) return local;
  // Vocab-parallel: every rank computes its slice of the logits; the all-gather (equal chunks:
  // the last rank's is padded) gives every rank all of them, so they all sample alike.
  const int64_t chunk = layout.vocab_chunk, world = layout.world_size;
  Tensor padded = local;
  if (layout.vocab.size() != chunk) {
    padded = Tensor::Zeros({rows, chunk}, DType::kF32, device);
    kernels::CopyColumns(local, 0, local.dim(1), &padded, 0);
  }
  Tensor gathered;  // [world, rows, chunk]
  comm.AllGather(padded, &gathered);
  Tensor logits = Tensor::Empty({rows, vocab}, DType::kF32, device);
  for (int64_t k = 0; k < world; ++k) {
    const int64_t begin = std::min(vocab, k * chunk);
    const int64_t n = std::min(vocab, (k + 1) * chunk) - begin;
    kernels::CopyColumns(gathered.Rows(k, k + 1).Reshape({rows, chunk}), 0, n, &logits, begin);
  }
  return logits;
}

void CausalLM::Embed(const Tensor& ids, Tensor* x) const {
  EmbedTokens(ids, w_.embed, layout_, *comm_, x);
}

Tensor CausalLM::LmHead(const Tensor& normed) const {
  Tensor logits = VocabLogits(normed, w_.lm_head, w_.lm_head_b.defined() ? &w_.lm_head_b : nullptr,
                              layout_, spec_.vocab, *comm_);
  if (spec_.logits_scale != 1.0f) kernels::Scale(spec_.logits_scale, &logits);
  if (spec_.final_logit_softcap > 0) kernels::SoftCap(spec_.final_logit_softcap, &logits);
  return logits;
}

void CausalLM::Norm(const Tensor& x, const Tensor& w, const Tensor& b, Tensor* out) const {
  if (spec_.norm == NormKind::kRms) {
    kernels::RmsNorm(x, w, spec_.norm_eps, out);
  } else {
    kernels::LayerNorm(x, w, b.defined() ? &b : nullptr, spec_.norm_eps, out);
  }
}

void CausalLM::AddNorm(Tensor* x, const Tensor& y, const Tensor& w, const Tensor& b,
                       Tensor* out) const {
  if (spec_.norm == NormKind::kRms) {
    kernels::AddRmsNorm(x, y, w, spec_.norm_eps, out);
  } else {
    kernels::AddInPlace(x, y);
    Norm(*x, w, b, out);
  }
}

// This rank's part of the MLP output (before the all-reduce).
void CausalLM::Mlp(const ForwardInput& in, int64_t layer, const Tensor& x, Tensor* out) const {
  const LayerWeights& w = w_.layers[layer];
  if (spec_.num_experts > 0) {
    MixtureOfExperts(w, x, out);
  } else {
    DenseMlp(w.up_w, w.up_b, w.down_w, w.down_b, layout_.intermediate.size(), x, out, &in, layer);
  }
}

void CausalLM::DenseMlp(const Tensor& up_w, const Tensor& up_b, const Tensor& down_w,
                        const Tensor& down_b, int64_t inter, const Tensor& x, Tensor* out,
                        const ForwardInput* in, int64_t layer) const {
  const int64_t t = x.dim(0);
  const bool gated = spec_.mlp == MlpKind::kGated;
  Tensor up = Buf({t, gated ? 2 * inter : inter});
  kernels::Linear(x, up_w, up_b.defined() ? &up_b : nullptr, &up);
  if (in != nullptr) AddLora(*in, layer, &LoraLayer::up, x, &up);
  Tensor act = up;
  if (gated && spec_.glu_limit > 0) {
    act = Buf({t, inter});
    kernels::ClampedSwiGlu(up, spec_.glu_alpha, spec_.glu_limit, &act);
  } else if (gated) {
    act = Buf({t, inter});
    kernels::GatedActivation(spec_.act, up, &act);
  } else {
    kernels::Activate(spec_.act, &act);
  }
  kernels::Linear(act, down_w, RowParallelBias(down_b), out);
  if (in != nullptr) AddLora(*in, layer, &LoraLayer::down, act, out);
}

void CausalLM::AddLora(const ForwardInput& in, int64_t layer, LoraPair LoraLayer::*which,
                       const Tensor& x, Tensor* y) const {
  for (const ForwardInput::LoraRows& group : in.lora) {
    const LoraPair& p = group.adapter->layers[layer].*which;
    if (!p.defined()) continue;
    // PEFT's order: lora_B(lora_A(x)) * scaling added to the base output (AddWeightedRows
    // scales and adds, rounding as torch does in 16 bits).
    const int64_t n = group.rows.dim(0);
    Tensor xs = x;
    if (!group.all_rows) {
      xs = Buf({n, x.dim(1)});
      kernels::Embedding(group.rows, x, &xs);  // a row gather
    }
    Tensor down = Buf({n, p.a.dim(0)});
    kernels::Linear(xs, p.a, nullptr, &down);
    Tensor delta = Buf({n, p.b.dim(0)});
    kernels::Linear(down, p.b, nullptr, &delta);
    kernels::AddWeightedRows(delta, group.rows, group.scales, y);
  }
}

absl::StatusOr<std::shared_ptr<const LoraWeights>> CausalLM::MakeLora(
    const LoraAdapter& adapter) const {
  return MakeLoraWeights(adapter, spec_, layout_, act_dtype_, device_);
}

// Each head's columns out of qkv as rows of D, normed, and back: existing ops on every device,
// no host synchronisation (decode graphs capture it). A few copies of q and k beside the
// projections' weights.
void CausalLM::NormHeads(const LayerWeights& w, Tensor* qkv) const {
  const int64_t t = qkv->dim(0), d = spec_.head_dim;
  const int64_t hq = layout_.q_heads.size(), hk = layout_.kv_heads.size();
  const int world = layout_.world_size;
  const struct {
    int64_t first, heads;
    const Tensor &w, &b;
  } parts[] = {{0, hq, w.q_norm_w, w.q_norm_b}, {hq, hk, w.k_norm_w, w.k_norm_b}};
  for (const auto& part : parts) {
    const int64_t width = part.heads * d;
    Tensor heads = Buf({t, width});
    kernels::CopyColumns(*qkv, part.first * d, width, &heads, 0);
    // Rows of head_dim values; qk_norms_whole: rows of the whole projection, with tensor
    // parallelism gathered from every rank (ranks hold consecutive heads in rank order, so the
    // gathered rows are the whole projection's: an all-gather of q and of k a layer), this
    // rank's columns taken back after.
    Tensor rows = heads.Reshape({t * part.heads, d});
    int64_t mine = 0;
    if (spec_.qk_norms_whole) {
      rows = world > 1 ? ColumnsOfEveryRank(heads) : heads;
      mine = layout_.rank * width;
    }
    Tensor normed = Buf(rows.shape());
    Norm(rows, part.w, part.b, &normed);
    kernels::CopyColumns(normed.Reshape({t, normed.numel() / t}), mine, width, qkv, part.first * d);
  }
}

Tensor CausalLM::ColumnsOfEveryRank(const Tensor& mine) const {
  const int world = layout_.world_size;
  const int64_t t = mine.dim(0), width = mine.dim(1);
  Tensor gathered = Buf({world, t, width});
  comm_->AllGather(mine, &gathered);
  const Tensor by_rank = gathered.Reshape({world * t, width});
  Tensor rows = Buf({t, world * width});
  for (int r = 0; r < world; ++r) {
    kernels::CopyColumns(by_rank.Rows(r * t, (r + 1) * t), 0, width, &rows, r * width);
  }
  return rows;
}

void CausalLM::Rotate(const ForwardInput& in, Tensor* q, Tensor* k) const {
  const std::vector<int32_t>& starts = in.host_query_start;
  const std::vector<int32_t>& lens = in.host_context_lens;
  const int64_t original = spec_.rope_by_length->original_max_positions;
  auto rotate = [&](size_t first, size_t last, const kernels::RotaryConfig& cfg) {
    const int64_t begin = starts[first], end = starts[last];
    if (begin == end) return;
    Tensor qs = q->Rows(begin, end), ks = k->Rows(begin, end);
    kernels::Rotary(cfg, in.positions.Rows(begin, end), &qs, &ks);
  };
  // Runs of sequences within the original context share the base frequencies; each longer one
  // gets those of its own length.
  for (size_t seq = 0; seq < lens.size();) {
    if (lens[seq] <= original) {
      size_t end = seq;
      while (end < lens.size() && lens[end] <= original) ++end;
      rotate(seq, end, spec_.rotary);
      seq = end;
    } else {
      kernels::RotaryConfig cfg = spec_.rotary;
      cfg.inv_freq = spec_.rope_by_length->InvFreq(lens[seq]);
      rotate(seq, seq + 1, cfg);
      ++seq;
    }
  }
}

// The input rows of a step: token embeddings (prompt-tuning rows in place of virtual tokens),
// projected in, learned positions added, normed (BLOOM).
Tensor CausalLM::InputRows(const ForwardInput& in) const {
  const DecoderSpec& s = spec_;
  const int64_t t = in.input_ids.dim(0), e = s.EmbedDim();
  Tensor x = Buf({t, e});
  Embed(in.input_ids, &x);
  MixPrefixRows(in, &x);
  // After the prompt-tuning rows, as transformers scales whatever inputs_embeds it is given.
  if (s.embed_scale != 1.0f) {
    float factor = s.embed_scale;
    if (s.embed_scale_in_act_dtype && act_dtype_ == DType::kBF16) {
      factor = kernels::Bf16ToF32(kernels::F32ToBf16(factor));
    } else if (s.embed_scale_in_act_dtype && act_dtype_ == DType::kF16) {
      factor = kernels::F16ToF32(kernels::F32ToF16(factor));
    }
    kernels::Scale(factor, &x);
  }
  if (e != s.hidden) {
    Tensor projected = Buf({t, s.hidden});
    kernels::Linear(x, w_.project_in, nullptr, &projected);
    x = projected;
  }
  if (s.position == PositionKind::kLearned) {
    Tensor pos = Buf({t, s.hidden});
    kernels::Embedding(in.positions, w_.pos_embed, &pos);
    kernels::AddInPlace(&x, pos);
  }
  if (s.embed_norm) {
    Tensor normed = Buf({t, s.hidden});
    Norm(x, w_.embed_norm_w, w_.embed_norm_b, &normed);
    x = normed;
  }
  return x;
}

std::vector<kernels::Shape> DecoderSpec::RecurrentStateShapes() const {
  std::vector<kernels::Shape> shapes;
  for (int64_t l = 0; l < num_layers; ++l) {
    if (!IsMamba(l)) continue;
    shapes.push_back({mamba.conv_channels(), mamba.ssm.conv_kernel - 1});
    shapes.push_back({mamba.ssm.heads, mamba.ssm.head_dim, mamba.ssm.state_size});
  }
  return shapes;
}

void CausalLM::MambaMixer(const ForwardInput& in, int64_t layer, const Tensor& x,
                          Tensor* out) const {
  const MambaSpec& m = spec_.mamba;
  const LayerWeights& w = w_.layers[layer];
  const int64_t t = x.dim(0);
  // This layer's two states in each sequence's slot: the Mamba-2 layers before it took two each.
  size_t first = 0;
  for (int64_t l = 0; l < layer; ++l) first += spec_.IsMamba(l) ? 2 : 0;
  std::vector<Tensor*> conv, ssm;
  for (std::vector<Tensor>* states : in.recurrent) {
    conv.push_back(&(*states)[first]);
    ssm.push_back(&(*states)[first + 1]);
  }
  Tensor proj = Buf({t, m.projection()});
  kernels::Linear(x, w.mamba_in_w, w.mamba_in_b.defined() ? &w.mamba_in_b : nullptr, &proj);
  Tensor zy = Buf({t, 2 * m.inner()});
  kernels::SelectiveScan(m.ssm, proj, w.conv_w, w.conv_b, w.dt_bias, w.a_log, w.ssm_d,
                         in.host_query_start, conv, ssm, in.recurrent_fresh, &zy);
  // transformers' gated RMSNorm: norm(y * silu(z)) over the whole inner width, so with tensor
  // parallelism over every rank's heads gathered (the sums of squares as at world size 1), this
  // rank's columns taken back for its part of out_proj.
  Tensor gated = Buf({t, m.inner()});
  kernels::GatedActivation(kernels::Activation::kSilu, zy, &gated);
  const bool parallel = layout_.world_size > 1;
  const Tensor whole = parallel ? ColumnsOfEveryRank(gated) : gated;
  Tensor normed = Buf(whole.shape());
  kernels::RmsNorm(whole, w.mamba_norm_w, spec_.norm_eps, &normed);
  if (parallel) {
    kernels::CopyColumns(normed, layout_.rank * m.inner(), m.inner(), &gated, 0);
    normed = gated;
  }
  kernels::Linear(normed, w.mamba_out_w, RowParallelBias(w.mamba_out_b), out);
}

Tensor CausalLM::ForwardHidden(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                               const std::vector<int32_t>& logit_rows) const {
  const DecoderSpec& s = spec_;
  const int64_t t = in.input_ids.dim(0);
  const int64_t hq = layout_.q_heads.size(), hk = layout_.kv_heads.size(), d = s.head_dim;
  const bool parallel = layout_.world_size > 1;
  const bool post_norm = s.residual == Residual::kPostNorm;
  // The attention's input is the residual stream itself (no input norm).
  const bool raw_input = post_norm || s.residual == Residual::kOutputNorms;
  Tensor x = InputRows(in);
  Tensor h = Buf({t, s.hidden});
  Tensor qkv = Buf({t, (hq + 2 * hk) * d});
  Tensor q = Buf({t, hq, d});
  // Rotary frequencies that depend on each sequence's length (Phi-3's longrope) rotate runs of
  // rows apart, through k and v buffers; every other model splits, rotates and caches q|k|v in
  // one op.
  const bool split_apart = s.position == PositionKind::kRotary && s.rope_by_length.has_value();
  Tensor k, v;
  if (split_apart) {
    k = Buf({t, hk, d});
    v = Buf({t, hk, d});
  }
  const bool rotary = s.position == PositionKind::kRotary;
  Tensor attn = Buf({t, hq, d});
  Tensor o = Buf({t, s.hidden});
  Tensor m = Buf({t, s.hidden});
  // An attention or MLP output (whole, after its all-reduce) before its residual add.
  auto residual_scaled = [&](Tensor* y) {
    if (s.residual_scale != 1.0f) kernels::Scale(s.residual_scale, y);
  };
  if (!raw_input) Norm(x, w_.layers[0].ln1_w, w_.layers[0].ln1_b, &h);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const LayerWeights& w = w_.layers[l];
    const LayerWeights* next = l + 1 < s.num_layers ? &w_.layers[l + 1] : nullptr;
    if (s.IsMamba(l)) {
      // A Mamba-2 mixer in place of attention (sequential residual: its input is h).
      MambaMixer(in, l, h, &o);
    } else {
      // The attention's input: this layer's input norm in h (pre-norm), or x itself.
      kernels::Linear(raw_input ? x : h, w.qkv_w, w.qkv_b.defined() ? &w.qkv_b : nullptr, &qkv);
      AddLora(in, l, &LoraLayer::qkv, raw_input ? x : h, &qkv);
      if (s.clip_qkv > 0) kernels::Clamp(-s.clip_qkv, s.clip_qkv, &qkv);
      if (s.qk_norms) NormHeads(w, &qkv);
      if (split_apart) {
        Tensor q2 = q.Reshape({t, hq * d}), k2 = k.Reshape({t, hk * d}),
               v2 = v.Reshape({t, hk * d});
        kernels::CopyColumns(qkv, 0, hq * d, &q2, 0);
        kernels::CopyColumns(qkv, hq * d, hk * d, &k2, 0);
        kernels::CopyColumns(qkv, (hq + hk) * d, hk * d, &v2, 0);
        Rotate(in, &q, &k);
        kernels::ReshapeAndCache(k, v, in.slot_mapping, &(*cache)[l]);
      } else {
        kernels::QkvToCache(qkv, rotary ? &s.RotaryOf(l) : nullptr, in.positions, in.slot_mapping,
                            &q, &(*cache)[l]);
      }
      kernels::PagedAttention(q, (*cache)[l], in.attn, s.attn_scale, s.WindowOf(l),
                              AttentionBiasOf(l), &attn);
      kernels::Linear(attn.Reshape({t, hq * d}), w.o_w, RowParallelBias(w.o_b), &o);
      AddLora(in, l, &LoraLayer::o, attn.Reshape({t, hq * d}), &o);
    }
    if (post_norm) {
      // x = ln1(x + attn); x = ln2(x + mlp(x)): the sums land in x, the norms in h, and the
      // two swap roles.
      comm_->AllReduceSum(&o);
      residual_scaled(&o);
      AddNorm(&x, o, w.ln1_w, w.ln1_b, &h);
      std::swap(x, h);
      Mlp(in, l, x, &m);
      comm_->AllReduceSum(&m);
      residual_scaled(&m);
      AddNorm(&x, m, w.ln2_w, w.ln2_b, &h);
      std::swap(x, h);
    } else if (s.residual == Residual::kSandwich) {
      // x += post_attn_norm(attn); h = ln2(x); x += post_mlp_norm(mlp(h)); h = next ln1(x).
      comm_->AllReduceSum(&o);
      Norm(o, w.post_attn_norm_w, w.post_attn_norm_b, &m);
      AddNorm(&x, m, w.ln2_w, w.ln2_b, &h);
      Mlp(in, l, h, &m);
      comm_->AllReduceSum(&m);
      Norm(m, w.post_mlp_norm_w, w.post_mlp_norm_b, &o);
      if (next != nullptr) {
        AddNorm(&x, o, next->ln1_w, next->ln1_b, &h);
      } else {
        kernels::AddInPlace(&x, o);
      }
    } else if (s.residual == Residual::kOutputNorms) {
      // x += post_attn_norm(attn); x += post_mlp_norm(mlp(x)).
      comm_->AllReduceSum(&o);
      Norm(o, w.post_attn_norm_w, w.post_attn_norm_b, &m);
      kernels::AddInPlace(&x, m);
      Mlp(in, l, x, &m);
      comm_->AllReduceSum(&m);
      Norm(m, w.post_mlp_norm_w, w.post_mlp_norm_b, &o);
      kernels::AddInPlace(&x, o);
    } else if (s.residual == Residual::kParallel) {
      Norm(x, w.ln2_w, w.ln2_b, &h);
      Mlp(in, l, h, &m);
      if (parallel) {
        // x + attn + mlp: one all-reduce of this rank's attn + mlp parts.
        kernels::AddInPlace(&o, m);
        comm_->AllReduceSum(&o);
        residual_scaled(&o);
        kernels::AddInPlace(&x, o);
      } else {
        residual_scaled(&o);
        residual_scaled(&m);
        kernels::AddInPlace(&x, o);
        kernels::AddInPlace(&x, m);
      }
      if (next != nullptr) Norm(x, next->ln1_w, next->ln1_b, &h);
    } else {
      comm_->AllReduceSum(&o);
      residual_scaled(&o);
      AddNorm(&x, o, w.ln2_w, w.ln2_b, &h);
      Mlp(in, l, h, &m);
      comm_->AllReduceSum(&m);
      residual_scaled(&m);
      if (next != nullptr) {
        AddNorm(&x, m, next->ln1_w, next->ln1_b, &h);
      } else {
        kernels::AddInPlace(&x, m);
      }
    }
  }
  // Only the rows whose logits are wanted go through the final norm and the lm_head.
  Tensor last = SelectRows(x, logit_rows);
  Tensor normed = last;
  if (w_.final_norm_w.defined()) {
    normed = Buf(last.shape());
    Norm(last, w_.final_norm_w, w_.final_norm_b, &normed);
  }
  if (s.EmbedDim() != s.hidden) {
    Tensor projected = Buf({normed.dim(0), s.EmbedDim()});
    kernels::Linear(normed, w_.project_out, nullptr, &projected);
    normed = projected;
  }
  return normed;
}

}  // namespace tgis::server

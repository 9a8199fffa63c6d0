#include "server/decoder_model.h"

#include <cmath>
#include <cstring>

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

absl::Status ValidateWeights(const DecoderSpec& s, const DecoderWeights& w) {
  const int64_t qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim;
  const int64_t up = s.mlp == MlpKind::kGatedSilu ? 2 * s.intermediate : s.intermediate;
  if (auto st = CheckShape(w.embed, {s.vocab, s.hidden}, "embedding"); !st.ok()) return st;
  if (auto st = CheckShape(w.lm_head, {s.vocab, s.hidden}, "lm_head"); !st.ok()) return st;
  if (static_cast<int64_t>(w.layers.size()) != s.num_layers) {
    return absl::InvalidArgumentError("layer count does not match the config");
  }
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layer ", i, " ");
    for (auto [t, shape, name] :
         {std::tuple{&l.qkv_w, kernels::Shape{qkv, s.hidden}, "qkv"},
          std::tuple{&l.o_w, kernels::Shape{s.hidden, s.num_heads * s.head_dim}, "o_proj"},
          std::tuple{&l.up_w, kernels::Shape{up, s.hidden}, "mlp up"},
          std::tuple{&l.down_w, kernels::Shape{s.hidden, s.intermediate}, "mlp down"},
          std::tuple{&l.ln1_w, kernels::Shape{s.hidden}, "input norm"},
          std::tuple{&l.ln2_w, kernels::Shape{s.hidden}, "post-attention norm"}}) {
      if (auto st = CheckShape(*t, shape, p + name); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

CausalLM::CausalLM(DecoderSpec spec, DecoderWeights weights)
    : spec_(std::move(spec)), w_(std::move(weights)) {
  if (spec_.attn_scale == 0) spec_.attn_scale = 1.0f / std::sqrt(static_cast<float>(spec_.head_dim));
  if (spec_.position == PositionKind::kAlibi) {
    alibi_ = kernels::AlibiSlopes(static_cast<int>(spec_.num_heads));
  }
}

size_t CausalLM::KvBytesPerToken() const {
  return static_cast<size_t>(2 * spec_.num_layers * spec_.num_kv_heads * spec_.head_dim) *
         sizeof(float);
}

void CausalLM::Norm(const Tensor& x, const Tensor& w, const Tensor& b, Tensor* out) const {
  if (spec_.norm == NormKind::kRms) {
    kernels::RmsNorm(x, w, spec_.norm_eps, out);
  } else {
    kernels::LayerNorm(x, w, b.defined() ? &b : nullptr, spec_.norm_eps, out);
  }
}

void CausalLM::Mlp(const LayerWeights& w, const Tensor& x, Tensor* out) const {
  const int64_t t = x.dim(0);
  if (spec_.mlp == MlpKind::kGatedSilu) {
    Tensor gate_up = Tensor::Empty({t, 2 * spec_.intermediate}, DType::kF32);
    kernels::Linear(x, w.up_w, w.up_b.defined() ? &w.up_b : nullptr, &gate_up);
    Tensor act = Tensor::Empty({t, spec_.intermediate}, DType::kF32);
    kernels::SiluMul(gate_up, &act);
    kernels::Linear(act, w.down_w, w.down_b.defined() ? &w.down_b : nullptr, out);
  } else {
    Tensor h = Tensor::Empty({t, spec_.intermediate}, DType::kF32);
    kernels::Linear(x, w.up_w, w.up_b.defined() ? &w.up_b : nullptr, &h);
    kernels::Gelu(spec_.gelu, &h);
    kernels::Linear(h, w.down_w, w.down_b.defined() ? &w.down_b : nullptr, out);
  }
}

Tensor CausalLM::Forward(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                         const std::vector<int32_t>& logit_rows) const {
  const DecoderSpec& s = spec_;
  const int64_t t = in.input_ids.dim(0);
  Tensor x = Tensor::Empty({t, s.hidden}, DType::kF32);
  kernels::Embedding(in.input_ids, w_.embed, &x);
  if (s.position == PositionKind::kLearned) {
    Tensor pos = Tensor::Empty({t, s.hidden}, DType::kF32);
    kernels::Embedding(in.positions, w_.pos_embed, &pos);
    kernels::AddInPlace(&x, pos);
  }
  Tensor h = Tensor::Empty({t, s.hidden}, DType::kF32);
  Tensor qkv = Tensor::Empty({t, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim}, DType::kF32);
  Tensor attn = Tensor::Empty({t, s.num_heads, s.head_dim}, DType::kF32);
  Tensor o = Tensor::Empty({t, s.hidden}, DType::kF32);
  Tensor m = Tensor::Empty({t, s.hidden}, DType::kF32);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const LayerWeights& w = w_.layers[l];
    Norm(x, w.ln1_w, w.ln1_b, &h);
    kernels::Linear(h, w.qkv_w, w.qkv_b.defined() ? &w.qkv_b : nullptr, &qkv);
    Tensor q, k, v;
    SplitQkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim, &q, &k, &v);
    if (s.position == PositionKind::kRotary) kernels::Rotary(s.rotary, in.positions, &q, &k);
    kernels::ReshapeAndCache(k, v, in.slot_mapping, &(*cache)[l]);
    kernels::PagedAttention(q, (*cache)[l], in.attn, s.attn_scale, s.sliding_window,
                            alibi_.empty() ? nullptr : &alibi_, &attn);
    kernels::Linear(attn.Reshape({t, s.num_heads * s.head_dim}), w.o_w,
                    w.o_b.defined() ? &w.o_b : nullptr, &o);
    if (s.parallel_residual) {
      Norm(x, w.ln2_w, w.ln2_b, &h);
      Mlp(w, h, &m);
      kernels::AddInPlace(&x, o);
      kernels::AddInPlace(&x, m);
    } else {
      kernels::AddInPlace(&x, o);
      Norm(x, w.ln2_w, w.ln2_b, &h);
      Mlp(w, h, &m);
      kernels::AddInPlace(&x, m);
    }
  }
  Tensor last = GatherRows(x, logit_rows);
  Tensor normed = Tensor::Empty(last.shape(), DType::kF32);
  Norm(last, w_.final_norm_w, w_.final_norm_b, &normed);
  Tensor logits = Tensor::Empty({static_cast<int64_t>(logit_rows.size()), s.vocab}, DType::kF32);
  kernels::Linear(normed, w_.lm_head, nullptr, &logits);
  return logits;
}

}  // namespace tgis::server

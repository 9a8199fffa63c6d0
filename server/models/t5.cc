// T5, FLAN-T5 (T5 v1.1), mT5 and mt0: encoder-decoder transformers with RMS layer norms, no
// biases, no attention scaling, T5 relative position buckets (owned by block 0 of each stack,
// bidirectional in the encoder, past-only in the decoder, none in cross-attention), a ReLU or
// gated-GELU feed-forward, and, with tied embeddings, the decoder output scaled by
// d_model^-0.5 before the lm_head.
//
// The encoder runs once per request (Encode): its self-attention uses the sequence's
// cross-attention cache blocks of layer 0 as scratch, and its output's keys/values for every
// decoder layer then go to those blocks. Decoder steps attend to them (ForwardInput::cross_attn).
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/model_registry.h"
#include "server/models/weight_utils.h"

namespace tgis::server {

namespace {

using kernels::DType;
using kernels::Tensor;

struct FeedForward {
  Tensor up_w;    // [2I, H] (wi_0 | wi_1, gated) or [I, H] (wi)
  Tensor down_w;  // [H, I] (wo)
};

struct EncoderLayer {
  Tensor ln_attn, ln_ff;
  Tensor qkv_w, o_w;
  FeedForward ff;
};

struct DecoderLayer {
  Tensor ln_self, ln_cross, ln_ff;
  Tensor qkv_w, o_w;                        // self-attention
  Tensor cross_q_w, cross_kv_w, cross_o_w;  // cross-attention (k | v rows)
  FeedForward ff;
};

struct T5Options {
  bool gated = false;
  kernels::Activation act = kernels::Activation::kRelu;
  int32_t decoder_start = 0;
  int64_t encoder_layers = 0;
  int num_buckets = 32;
  int max_distance = 128;
};

class T5Model : public Model {
 public:
  T5Model(DecoderSpec spec, ShardLayout layout, T5Options opt, std::shared_ptr<Communicator> comm)
      : spec_(std::move(spec)), layout_(layout), opt_(opt), comm_(std::move(comm)) {}

  Tensor embed, lm_head, encoder_final_ln, decoder_final_ln;
  Tensor encoder_table, decoder_table;  // [this rank's heads, buckets] f32
  std::vector<EncoderLayer> encoder;
  std::vector<DecoderLayer> decoder;

  bool encoder_decoder() const override { return true; }
  int32_t decoder_start_token() const override { return opt_.decoder_start; }
  kernels::Device device() const override { return device_; }
  kernels::DType act_dtype() const override { return act_dtype_; }
  kernels::DType kv_dtype() const override {
    std::vector<const Tensor*> linears;
    for (const EncoderLayer& l : encoder)
      linears.insert(linears.end(), {&l.qkv_w, &l.o_w, &l.ff.up_w, &l.ff.down_w});
    for (const DecoderLayer& l : decoder) {
      linears.insert(linears.end(), {&l.qkv_w, &l.o_w, &l.cross_q_w, &l.cross_kv_w, &l.cross_o_w,
                                     &l.ff.up_w, &l.ff.down_w});
    }
    return KvCacheDType(device_, act_dtype_, linears);
  }
  const DecoderSpec& spec() const override { return spec_; }
  const ShardLayout& shard() const override { return layout_; }
  Communicator& communicator() const override { return *comm_; }
  size_t KvBytesPerToken() const override {
    return static_cast<size_t>(2 * spec_.num_layers * layout_.kv_heads.size() * spec_.head_dim) *
           kernels::DTypeSize(kv_dtype());
  }

  void MoveTo(kernels::Device device) override {
    if (device == device_) {
      if (device == kernels::Device::kCpu) {
        kernels::PrepareCpuWeight(&lm_head);
        for (EncoderLayer& l : encoder) {
          for (Tensor* t : {&l.qkv_w, &l.o_w, &l.ff.up_w, &l.ff.down_w})
            kernels::PrepareCpuWeight(t);
        }
        for (DecoderLayer& l : decoder) {
          for (Tensor* t : {&l.qkv_w, &l.o_w, &l.cross_q_w, &l.cross_kv_w, &l.cross_o_w, &l.ff.up_w,
                            &l.ff.down_w}) {
            kernels::PrepareCpuWeight(t);
          }
        }
      }
      return;
    }
    const DType dtype = decoder[0].qkv_w.dtype();
    auto move = [&](Tensor* t) { MoveWeight(t, dtype, device); };
    const bool tied = lm_head.raw() == embed.raw();
    move(&embed);
    if (tied) {
      lm_head = embed;
    } else {
      move(&lm_head);
    }
    move(&encoder_final_ln);
    move(&decoder_final_ln);
    // The bias tables stay f32 (the attention kernels read them so).
    encoder_table = encoder_table.ToDevice(device);
    decoder_table = decoder_table.ToDevice(device);
    for (EncoderLayer& l : encoder) {
      for (Tensor* t : {&l.ln_attn, &l.ln_ff, &l.qkv_w, &l.o_w, &l.ff.up_w, &l.ff.down_w}) move(t);
    }
    for (DecoderLayer& l : decoder) {
      for (Tensor* t : {&l.ln_self, &l.ln_cross, &l.ln_ff, &l.qkv_w, &l.o_w, &l.cross_q_w,
                        &l.cross_kv_w, &l.cross_o_w, &l.ff.up_w, &l.ff.down_w}) {
        move(t);
      }
    }
    device_ = device;
    act_dtype_ = dtype;
  }

  void Encode(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache) const override {
    const int64_t t = in.input_ids.dim(0);
    const int64_t hk = layout_.kv_heads.size(), d = spec_.head_dim;
    Tensor x = Buf({t, spec_.hidden});
    EmbedTokens(in.input_ids, embed, layout_, *comm_, &x);
    MixPrefixRows(in, &x);
    kernels::AttentionBias bias = Bias(encoder_table, /*bidirectional=*/true);
    for (const EncoderLayer& l : encoder) {
      // Layer 0's cache blocks of these sequences are scratch for the encoder's keys/values.
      SelfAttention(in, l.ln_attn, l.qkv_w, l.o_w, bias, &(*cache)[0], &x);
      FeedForwardBlock(l.ln_ff, l.ff, &x);
    }
    Tensor h = Buf({t, spec_.hidden});
    kernels::RmsNorm(x, encoder_final_ln, spec_.norm_eps, &h);
    Tensor kv = Buf({t, 2 * hk * d});
    Tensor k = Buf({t, hk, d}), v = Buf({t, hk, d});
    Tensor k2 = k.Reshape({t, hk * d}), v2 = v.Reshape({t, hk * d});
    for (size_t i = 0; i < decoder.size(); ++i) {
      kernels::Linear(h, decoder[i].cross_kv_w, nullptr, &kv);
      kernels::CopyColumns(kv, 0, hk * d, &k2, 0);
      kernels::CopyColumns(kv, hk * d, hk * d, &v2, 0);
      kernels::ReshapeAndCache(k, v, in.slot_mapping, &(*cache)[i]);
    }
  }

  Tensor ForwardHidden(const ForwardInput& in, std::vector<kernels::KvCacheLayer>* cache,
                       const std::vector<int32_t>& logit_rows) const override {
    const int64_t t = in.input_ids.dim(0);
    const int64_t hq = layout_.q_heads.size(), d = spec_.head_dim;
    Tensor x = Buf({t, spec_.hidden});
    EmbedTokens(in.input_ids, embed, layout_, *comm_, &x);
    MixPrefixRows(in, &x);
    kernels::AttentionBias bias = Bias(decoder_table, /*bidirectional=*/false);
    Tensor h = Buf({t, spec_.hidden}), q = Buf({t, hq, d}), attn = Buf({t, hq, d});
    Tensor o = Buf({t, spec_.hidden});
    for (size_t i = 0; i < decoder.size(); ++i) {
      const DecoderLayer& l = decoder[i];
      SelfAttention(in, l.ln_self, l.qkv_w, l.o_w, bias, &(*cache)[i], &x);
      // Cross-attention over the encoder's keys/values (no position bias, no scaling).
      kernels::RmsNorm(x, l.ln_cross, spec_.norm_eps, &h);
      Tensor q2 = q.Reshape({t, hq * d});
      kernels::Linear(h, l.cross_q_w, nullptr, &q2);
      kernels::PagedAttention(q, (*cache)[i], in.cross_attn, 1.0f, 0, nullptr, &attn);
      kernels::Linear(attn.Reshape({t, hq * d}), l.cross_o_w, nullptr, &o);
      comm_->AllReduceSum(&o);
      kernels::AddInPlace(&x, o);
      FeedForwardBlock(l.ln_ff, l.ff, &x);
    }
    Tensor last = SelectRows(x, logit_rows);
    // With tied embeddings the final norm's weight carries the d_model^-0.5 output scaling.
    Tensor normed = Buf(last.shape());
    kernels::RmsNorm(last, decoder_final_ln, spec_.norm_eps, &normed);
    return normed;
  }

  Tensor Logits(const Tensor& hidden) const override {
    return VocabLogits(hidden, lm_head, nullptr, layout_, spec_.vocab, *comm_);
  }

 private:
  Tensor Buf(const kernels::Shape& shape) const {
    return Tensor::Empty(shape, act_dtype_, device_);
  }

  kernels::AttentionBias Bias(const Tensor& table, bool bidirectional) const {
    kernels::AttentionBias b;
    b.relative_table = table;
    b.num_buckets = opt_.num_buckets;
    b.max_distance = opt_.max_distance;
    b.bidirectional = bidirectional;
    return b;
  }

  // x += o(attention(q, k, v of norm(x))), keys/values written at in.slot_mapping of `cache`.
  void SelfAttention(const ForwardInput& in, const Tensor& ln, const Tensor& qkv_w,
                     const Tensor& o_w, const kernels::AttentionBias& bias,
                     kernels::KvCacheLayer* cache, Tensor* x) const {
    const int64_t t = x->dim(0);
    const int64_t hq = layout_.q_heads.size(), hk = layout_.kv_heads.size(), d = spec_.head_dim;
    Tensor h = Buf({t, spec_.hidden});
    kernels::RmsNorm(*x, ln, spec_.norm_eps, &h);
    Tensor qkv = Buf({t, (hq + 2 * hk) * d});
    kernels::Linear(h, qkv_w, nullptr, &qkv);
    Tensor q = Buf({t, hq, d}), k = Buf({t, hk, d}), v = Buf({t, hk, d});
    Tensor q2 = q.Reshape({t, hq * d}), k2 = k.Reshape({t, hk * d}), v2 = v.Reshape({t, hk * d});
    kernels::CopyColumns(qkv, 0, hq * d, &q2, 0);
    kernels::CopyColumns(qkv, hq * d, hk * d, &k2, 0);
    kernels::CopyColumns(qkv, (hq + hk) * d, hk * d, &v2, 0);
    kernels::ReshapeAndCache(k, v, in.slot_mapping, cache);
    Tensor attn = Buf({t, hq, d});
    kernels::PagedAttention(q, *cache, in.attn, 1.0f, 0, &bias, &attn);
    Tensor o = Buf({t, spec_.hidden});
    kernels::Linear(attn.Reshape({t, hq * d}), o_w, nullptr, &o);
    comm_->AllReduceSum(&o);
    kernels::AddInPlace(x, o);
  }

  // x += wo(act(wi x)) or wo(act(wi_0 x) * wi_1 x), of norm(x).
  void FeedForwardBlock(const Tensor& ln, const FeedForward& ff, Tensor* x) const {
    const int64_t t = x->dim(0), inter = layout_.intermediate.size();
    Tensor h = Buf({t, spec_.hidden});
    kernels::RmsNorm(*x, ln, spec_.norm_eps, &h);
    Tensor act = Buf({t, inter});
    if (opt_.gated) {
      Tensor gate_up = Buf({t, 2 * inter});
      kernels::Linear(h, ff.up_w, nullptr, &gate_up);
      kernels::GatedActivation(opt_.act, gate_up, &act);
    } else {
      kernels::Linear(h, ff.up_w, nullptr, &act);
      kernels::Activate(opt_.act, &act);
    }
    Tensor o = Buf({t, spec_.hidden});
    kernels::Linear(act, ff.down_w, nullptr, &o);
    comm_->AllReduceSum(&o);
    kernels::AddInPlace(x, o);
  }

  DecoderSpec spec_;
  ShardLayout layout_;
  T5Options opt_;
  std::shared_ptr<Communicator> comm_;
  kernels::Device device_ = kernels::Device::kCpu;
  DType act_dtype_ = DType::kF32;
};

// [buckets, heads] (an nn.Embedding) -> this rank's heads as rows, f32.
absl::StatusOr<Tensor> BiasTable(const ShardedLoader& ld, const std::string& name, int64_t buckets,
                                 Range heads) {
  auto t = ld.Whole(name);
  if (!t.ok()) return t.status();
  if (t->rank() != 2 || t->dim(0) != buckets || t->dim(1) < heads.end) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected [", buckets, ", heads], got ", t->DebugString()));
  }
  Tensor out = Tensor::Empty({heads.size(), buckets}, DType::kF32);
  const float* src = t->data<float>();
  for (int64_t h = 0; h < heads.size(); ++h) {
    for (int64_t b = 0; b < buckets; ++b) {
      out.data<float>()[h * buckets + b] = src[b * t->dim(1) + heads.begin + h];
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Model>> Build(const ModelConfig& c, const WeightStore& w,
                                             DType dtype, std::shared_ptr<Communicator> comm) {
  auto d_kv = c.Get<int64_t>("d_kv");
  auto d_ff = c.Get<int64_t>("d_ff");
  auto layers = c.Get<int64_t>("num_layers");
  auto dec_layers = c.Get<int64_t>("num_decoder_layers", std::nullopt);
  auto buckets = c.Get<int64_t>("relative_attention_num_buckets", int64_t{32});
  auto distance = c.Get<int64_t>("relative_attention_max_distance", int64_t{128});
  auto eps = c.Get<double>("layer_norm_epsilon", 1e-6);
  auto proj = c.Get<std::string>("feed_forward_proj", std::string("relu"));
  for (const absl::Status& st : {d_kv.status(), d_ff.status(), layers.status(), buckets.status(),
                                 distance.status(), eps.status(), proj.status()}) {
    if (!st.ok()) return st;
  }
  if (*buckets < 4 || *buckets % 2 != 0 || *distance <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: relative_attention_num_buckets = ", *buckets,
        " and relative_attention_max_distance = ", *distance, " are not a usable bucket setting"));
  }
  T5Options opt;
  // T5Config: "gated-<act>" or "<act>"; "gated-gelu" means gelu_new (the tanh form).
  std::string act = *proj;
  if (act.rfind("gated-", 0) == 0) {
    opt.gated = true;
    act = act.substr(6);
  }
  if (opt.gated && act == "gelu") act = "gelu_new";
  auto activation = ActivationFromName(act, "feed_forward_proj");
  if (!activation.ok()) return activation.status();
  opt.act = *activation;
  opt.encoder_layers = *layers;
  opt.num_buckets = static_cast<int>(*buckets);
  opt.max_distance = static_cast<int>(*distance);
  // TGIS: decoder_start_token_id, else bos_token_id.
  if (auto it = c.raw.find("decoder_start_token_id");
      it != c.raw.end() && it->is_number_integer()) {
    opt.decoder_start = it->get<int32_t>();
  } else if (c.bos_token_id) {
    opt.decoder_start = *c.bos_token_id;
  } else {
    return absl::InvalidArgumentError(
        "config.json: decoder_start_token_id (or bos_token_id) is needed for an encoder-decoder "
        "model");
  }
  if (opt.decoder_start < 0 || opt.decoder_start >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: decoder_start_token_id = ", opt.decoder_start, " is not in the vocabulary"));
  }

  DecoderSpec s = MultiHeadSpec(c);  // the decoder stack's sizes (the KV cache's layers)
  s.num_layers = dec_layers.ok() ? *dec_layers : *layers;
  s.head_dim = *d_kv;  // heads x d_kv need not be d_model
  s.intermediate = *d_ff;
  s.norm = NormKind::kRms;
  s.norm_eps = static_cast<float>(*eps);
  s.position = PositionKind::kRelative;
  s.attn_scale = 1.0f;
  s.max_positions = -1;  // relative positions: no limit of their own
  const bool tied = c.raw.value("tie_word_embeddings", true);

  auto layout = ShardLayout::Make(s, comm->rank(), comm->world_size());
  if (!layout.ok()) return layout.status();
  const ShardedLoader ld(w, s, *layout, dtype);
  auto model = std::make_unique<T5Model>(s, *layout, opt, comm);
  const Range q = ld.q_rows(), kv = ld.kv_rows(), mlp = ld.mlp_rows();
  TensorLoads loads;
  loads.emplace_back(&model->embed, ld.VocabRows("shared.weight"));
  loads.emplace_back(&model->encoder_final_ln, ld.Whole("encoder.final_layer_norm.weight"));
  loads.emplace_back(&model->decoder_final_ln, ld.Whole("decoder.final_layer_norm.weight"));
  loads.emplace_back(
      &model->encoder_table,
      BiasTable(ld, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                *buckets, layout->q_heads));
  loads.emplace_back(
      &model->decoder_table,
      BiasTable(ld, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                *buckets, layout->q_heads));
  auto attention = [&](const std::string& a, Tensor* qkv_w, Tensor* o_w) {
    loads.emplace_back(
        qkv_w,
        ld.StackOutputRows({{a + "q.weight", q}, {a + "k.weight", kv}, {a + "v.weight", kv}}));
    loads.emplace_back(o_w, ld.InputColumns(a + "o.weight", q));
  };
  auto feed_forward = [&](const std::string& f, FeedForward* ff) {
    if (opt.gated) {
      loads.emplace_back(&ff->up_w,
                         ld.StackOutputRows({{f + "wi_0.weight", mlp}, {f + "wi_1.weight", mlp}}));
    } else {
      loads.emplace_back(&ff->up_w, ld.OutputRows(f + "wi.weight", {mlp}));
    }
    loads.emplace_back(&ff->down_w, ld.InputColumns(f + "wo.weight", mlp));
  };
  model->encoder.resize(opt.encoder_layers);
  for (int64_t i = 0; i < opt.encoder_layers; ++i) {
    const std::string p = absl::StrCat("encoder.block.", i, ".layer.");
    EncoderLayer& l = model->encoder[i];
    attention(p + "0.SelfAttention.", &l.qkv_w, &l.o_w);
    loads.emplace_back(&l.ln_attn, ld.Whole(p + "0.layer_norm.weight"));
    feed_forward(p + "1.DenseReluDense.", &l.ff);
    loads.emplace_back(&l.ln_ff, ld.Whole(p + "1.layer_norm.weight"));
  }
  model->decoder.resize(s.num_layers);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = absl::StrCat("decoder.block.", i, ".layer.");
    DecoderLayer& l = model->decoder[i];
    attention(p + "0.SelfAttention.", &l.qkv_w, &l.o_w);
    loads.emplace_back(&l.ln_self, ld.Whole(p + "0.layer_norm.weight"));
    const std::string x = p + "1.EncDecAttention.";
    loads.emplace_back(&l.cross_q_w, ld.OutputRows(x + "q.weight", {q}));
    loads.emplace_back(&l.cross_kv_w,
                       ld.StackOutputRows({{x + "k.weight", kv}, {x + "v.weight", kv}}));
    loads.emplace_back(&l.cross_o_w, ld.InputColumns(x + "o.weight", q));
    loads.emplace_back(&l.ln_cross, ld.Whole(p + "1.layer_norm.weight"));
    feed_forward(p + "2.DenseReluDense.", &l.ff);
    loads.emplace_back(&l.ln_ff, ld.Whole(p + "2.layer_norm.weight"));
  }
  if (!tied) loads.emplace_back(&model->lm_head, ld.VocabRows("lm_head.weight"));
  if (auto st = AssignLoads(&loads); !st.ok()) return st;
  if (tied) {
    // transformers scales the decoder output by d_model^-0.5 before a tied lm_head: fold it
    // into the final norm's weight (a copy: the loaded tensor may be a view of the file).
    model->lm_head = model->embed;
    if (w.Has("lm_head.weight")) w.MarkRead("lm_head.weight");
    Tensor scaled = model->decoder_final_ln.To(DType::kF32);
    if (scaled.raw() == model->decoder_final_ln.raw()) {
      scaled = Tensor::FromVector(
          std::vector<float>(scaled.data<float>(), scaled.data<float>() + scaled.numel()),
          scaled.shape());
    }
    const float factor = static_cast<float>(std::pow(static_cast<double>(s.hidden), -0.5));
    for (int64_t i = 0; i < scaled.numel(); ++i) scaled.data<float>()[i] *= factor;
    model->decoder_final_ln = scaled;
  }
  for (const Tensor* t : {&model->embed, &model->lm_head}) {
    if (t->rank() != 2 || t->dim(0) != layout->vocab.size() || t->dim(1) != s.hidden) {
      return absl::InvalidArgumentError(
          "shared.weight / lm_head.weight: expected [vocab, d_model]");
    }
  }
  return model;
}

}  // namespace

// encoder/decoder.embed_tokens.weight are the `shared` embedding under other names (older
// checkpoints store them too); EncDecAttention.relative_attention_bias is a stale tensor some
// Hub checkpoints carry and transformers never uses (cross-attention has no position bias).
void RegisterT5Models(ModelRegistry* r) {
  const std::vector<std::string> ignored = {
      "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
      "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"};
  r->Register("t5", Build, ignored);
  r->Register("mt5", Build, ignored);
}

}  // namespace tgis::server

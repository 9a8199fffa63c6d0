#include "server/models/weight_utils.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "kernels/quantized.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

absl::StatusOr<Tensor> ConcatRows(const std::vector<Tensor>& parts, const std::string& what,
                                  std::optional<DType> dense_dtype) {
  bool mixed = false, compatible = true;
  for (const Tensor& p : parts) {
    mixed |= (p.quantized() != nullptr) != (parts[0].quantized() != nullptr);
    compatible &= p.quantized() == nullptr || parts[0].quantized() == nullptr ||
                  kernels::QuantizedCompatible(*parts[0].quantized(), *p.quantized());
  }
  if (mixed || !compatible) {
    const std::string how = mixed ? "stored differently (some quantized, some dense)"
                                  : "quantized differently (bits, group order or g_idx)";
    if (!dense_dtype)
      return absl::InvalidArgumentError(absl::StrCat(what, ": the fused parts are ", how));
    // Checkpoints whose quantizer left some parts of a fused projection in 16 bits or gave
    // them other bits (AutoRound and GPTQModel's per-layer rules; transformers runs the parts
    // apart): the fused weight is served dense, each quantized part as it dequantizes.
    LOG(WARNING) << what << ": the fused parts are " << how
                 << "; served dense (more memory and bandwidth than quantized)";
    std::vector<Tensor> dense;
    for (const Tensor& p : parts) {
      dense.push_back(p.quantized() == nullptr
                          ? p.To(*dense_dtype)
                          : kernels::Dequantize(*p.quantized()).To(*dense_dtype));
    }
    return ConcatRows(dense, what);
  }
  if (parts[0].quantized() != nullptr) {
    std::vector<const kernels::QuantizedWeight*> qs;
    for (const Tensor& p : parts) qs.push_back(p.quantized());
    return Tensor::Quantized(
        std::make_shared<const kernels::QuantizedWeight>(kernels::ConcatQuantizedRows(qs)));
  }
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.dim(0);
  kernels::Shape shape = parts[0].shape();
  shape[0] = rows;
  Tensor out = Tensor::Empty(shape, parts[0].dtype());
  size_t off = 0;
  for (const Tensor& p : parts) {
    std::memcpy(static_cast<char*>(out.raw()) + off, p.raw(), p.nbytes());
    off += p.nbytes();
  }
  return out;
}

absl::StatusOr<kernels::Activation> ActivationFromName(const std::string& act,
                                                       const std::string& key) {
  if (act == "gelu") return kernels::Activation::kGeluErf;
  if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast") {
    return kernels::Activation::kGeluTanh;
  }
  if (act == "relu") return kernels::Activation::kRelu;
  if (act == "silu" || act == "swish") return kernels::Activation::kSilu;
  return absl::UnimplementedError(absl::StrCat("config.json: ", key, " = \"", act,
                                               "\" is not supported (gelu, gelu_new, "
                                               "gelu_pytorch_tanh, gelu_fast, relu, silu and "
                                               "swish are)"));
}

namespace {

// "x.weight" -> "x", the prefix a linear's quantized tensors share; nullopt for other names.
std::optional<std::string> LinearPrefix(const std::string& name) {
  constexpr std::string_view kSuffix = ".weight";
  if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) return std::nullopt;
  return name.substr(0, name.size() - kSuffix.size());
}

// out[j, i] = in[i, j], elements moved as T (same size as the dtype's).
template <typename T>
void Transpose(const Tensor& in, Tensor* out) {
  const int64_t r = in.dim(0), c = in.dim(1);
  const T* s = static_cast<const T*>(in.raw());
  T* d = static_cast<T*>(out->raw());
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < c; ++j) d[j * r + i] = s[i * c + j];
  }
}

// Calls f(T{}) with T the unsigned integer type of `es` bytes (1, 2, 4 or 8): elements moved
// as such.
template <typename F>
void WithElementType(size_t es, F&& f) {
  switch (es) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

// Ranges [begin, end) of `src` along `dim` (0 or 1 of a 2-D tensor, 0 of a 1-D one), copied
// in the stored dtype; transposed when `transpose` (2-D); then converted to `dtype`. Reads only
// the selected elements.
Tensor Select(const Tensor& src, int dim, const std::vector<Range>& ranges, bool transpose,
              DType dtype) {
  const size_t es = kernels::DTypeSize(src.dtype());
  int64_t n = 0;
  for (const Range& r : ranges) n += r.size();
  const bool matrix = src.rank() == 2;
  if (dim == 0 && !transpose && ranges.size() == 1 && src.dtype() == dtype) {
    return src.Rows(ranges[0].begin, ranges[0].end);  // a view
  }
  Tensor picked;
  if (dim == 0) {
    kernels::Shape shape = src.shape();
    shape[0] = n;
    picked = Tensor::Empty(shape, src.dtype());
    const size_t row = static_cast<size_t>(matrix ? src.dim(1) : 1) * es;
    char* dst = static_cast<char*>(picked.raw());
    for (const Range& r : ranges) {
      std::memcpy(dst, static_cast<const char*>(src.raw()) + r.begin * row, r.size() * row);
      dst += r.size() * row;
    }
  } else {
    const int64_t rows = src.dim(0), cols = src.dim(1);
    picked = Tensor::Empty({rows, n}, src.dtype());
    char* dst = static_cast<char*>(picked.raw());
    if (std::all_of(ranges.begin(), ranges.end(), [](const Range& r) { return r.size() == 1; })) {
      // Single columns (GPT-OSS's interleaved gate|up), element by element, not a call each.
      WithElementType(es, [&](auto zero) {
        using T = decltype(zero);
        const T* from = static_cast<const T*>(src.raw());
        T* to = reinterpret_cast<T*>(dst);
        for (int64_t i = 0; i < rows; ++i, to += n) {
          for (int64_t j = 0; j < n; ++j) to[j] = from[i * cols + ranges[j].begin];
        }
      });
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        const char* row = static_cast<const char*>(src.raw()) + i * cols * es;
        for (const Range& r : ranges) {
          std::memcpy(dst, row + r.begin * es, r.size() * es);
          dst += r.size() * es;
        }
      }
    }
  }
  if (transpose && matrix) {
    Tensor t = Tensor::Empty({picked.dim(1), picked.dim(0)}, picked.dtype());
    WithElementType(es, [&](auto zero) { Transpose<decltype(zero)>(picked, &t); });
    picked = t;
  }
  return picked.dtype() == dtype ? picked : picked.To(dtype);
}

}  // namespace

absl::StatusOr<Tensor> ShardedLoader::Raw(const std::string& name) const {
  auto t = w_.View(name);
  if (!t.ok()) return t.status();
  if (expert_) {
    // [experts, n] (GPT-OSS's per-expert biases) or [experts, rows, columns].
    if ((t->rank() != 3 && t->rank() != 2) || t->dim(0) != spec_.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       ": expected a 3-D tensor [experts, rows, columns] (biases: [experts, n]) of "
                       "the config's ",
                       spec_.num_experts, " experts (num_local_experts)"));
    }
    const Tensor e = t->Rows(*expert_, *expert_ + 1);
    return t->rank() == 2 ? e.Reshape({t->dim(1)}) : e.Reshape({t->dim(1), t->dim(2)});
  }
  if (t->rank() != 1 && t->rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a 1-D or 2-D tensor"));
  }
  return t;
}

bool ShardedLoader::StoresMxfp4(const std::string& name) const {
  return w_.quantization().method == QuantMethod::kMxfp4 && !w_.Has(name) &&
         w_.Has(name + "_blocks");
}

std::optional<absl::StatusOr<Tensor>> ShardedLoader::Quantized(const std::string& name,
                                                               const std::vector<Range>& rows,
                                                               std::optional<Range> range) const {
  const QuantConfig& q = w_.quantization();
  // Row-parallel inputs split evenly over the ranks (ShardLayout).
  std::optional<ColumnSlice> cols;
  if (range) cols = ColumnSlice{*range, range->size() * layout_.world_size};
  if (expert_ && StoresMxfp4(name)) {
    return LoadMxfp4Expert(w_, name, *expert_, spec_.num_experts, rows, cols);
  }
  if (q.method != QuantMethod::kGptq && q.method != QuantMethod::kAwq &&
      q.method != QuantMethod::kFp8 && q.method != QuantMethod::kCompressedInt &&
      q.method != QuantMethod::kBnbInt8 && q.method != QuantMethod::kBnb4) {
    return std::nullopt;
  }
  const std::optional<std::string> linear = LinearPrefix(name);
  if (!linear || expert_) return std::nullopt;
  const std::string& prefix = *linear;
  if (q.method == QuantMethod::kFp8) {
    // A linear left dense (the config's ignore list) has no scale; an fp8 weight without one
    // is refused by WeightStore::Get.
    if (!w_.Has(prefix + q.fp8_scale)) return std::nullopt;
    return LoadFp8Linear(w_, q, prefix, rows, cols);
  }
  if (q.method == QuantMethod::kCompressedInt) {
    // Likewise: a linear left dense has no weight_scale.
    if (!w_.Has(prefix + ".weight_scale")) return std::nullopt;
    return LoadCompressedIntLinear(w_, q, prefix, rows, cols);
  }
  if (q.method == QuantMethod::kBnbInt8) {
    // A linear left dense (llm_int8_skip_modules: the lm_head by default) has no SCB; int8
    // codes without one would be read as numbers.
    if (!w_.Has(prefix + ".SCB")) {
      auto t = w_.Has(name) ? w_.View(name) : absl::StatusOr<Tensor>(Tensor());
      if (t.ok() && t->defined() && t->dtype() == kernels::DType::kI8) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": int8 without ", prefix, ".SCB (", q.source, ")"));
      }
      return std::nullopt;
    }
    return LoadBnbInt8Linear(w_, q, prefix, rows, cols);
  }
  if (q.method == QuantMethod::kBnb4) {
    // Likewise a linear left dense has no quant_state record; packed codes without one would
    // be read as numbers.
    if (!Bnb4QuantStateOf(w_, prefix)) {
      auto t = w_.Has(name) ? w_.View(name) : absl::StatusOr<Tensor>(Tensor());
      if (t.ok() && t->defined() && t->dtype() == kernels::DType::kU8) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": uint8 without a quant_state.bitsandbytes__nf4 or __fp4 record (",
                         q.source, ")"));
      }
      return std::nullopt;
    }
    return LoadBnb4Linear(w_, q, prefix, rows, cols);
  }
  if (w_.Has(name) || !w_.Has(prefix + ".qweight")) return std::nullopt;  // a dense linear
  return LoadQuantizedLinear(w_, q, prefix, rows, cols);
}

absl::StatusOr<Tensor> ShardedLoader::MaybeQuantizeAtLoad(const std::string& name,
                                                          absl::StatusOr<Tensor> dense,
                                                          const Tensor* whole,
                                                          std::optional<Range> cols) const {
  const QuantConfig& quant = w_.quantization();
  if (!dense.ok() || dense->rank() != 2) return dense;
  if (quant.method == QuantMethod::kBnb4AtLoad) {
    // Blocks of whole rows, so that every world size quantizes alike.
    const Tensor& rows = whole != nullptr ? *whole : *dense;
    auto q = QuantizeBnb4AtLoad(rows, quant.bnb4_type, cols.value_or(Range{0, rows.dim(1)}), name);
    if (!q.ok() && !w_.FileOf(name).empty()) {
      return absl::Status(q.status().code(),
                          absl::StrCat(q.status().message(), " (", w_.FileOf(name), ")"));
    }
    return q;
  }
  if (quant.method != QuantMethod::kInt8AtLoad) return dense;
  std::vector<float> absmax;
  if (whole != nullptr) {  // [out, in] in the run dtype, as a world size of 1 would load it
    const Tensor f = whole->dtype() == DType::kF32 ? *whole : whole->To(DType::kF32);
    absmax.assign(f.dim(0), 0.f);
    for (int64_t n = 0; n < f.dim(0); ++n) {
      for (int64_t k = 0; k < f.dim(1); ++k) {
        absmax[n] = std::max(absmax[n], std::fabs(f.data<float>()[n * f.dim(1) + k]));
      }
    }
  }
  int64_t nonfinite = -1;
  auto q = std::make_shared<const kernels::QuantizedWeight>(
      kernels::QuantizeInt8Rows(*dense, whole != nullptr ? &absmax : nullptr, &nonfinite));
  if (nonfinite >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": row ", nonfinite, " holds a NaN or an infinity, which int8 (--quantize ",
        "bitsandbytes) cannot hold", w_.FileOf(name).empty() ? "" : " (" + w_.FileOf(name) + ")"));
  }
  return Tensor::Quantized(std::move(q));
}

absl::StatusOr<Tensor> ShardedLoader::Whole(const std::string& name, bool conv1d) const {
  auto t = Raw(name);
  if (!t.ok()) return t.status();
  return Select(*t, 0, {{0, t->dim(0)}}, conv1d, DType::kF32);
}

absl::StatusOr<Tensor> ShardedLoader::WholeShaped(const std::string& name,
                                                  const kernels::Shape& shape) const {
  auto t = w_.View(name);
  if (!t.ok()) return t.status();
  if (t->shape() != shape) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected [", absl::StrJoin(shape, ", "),
                                                   "], found [", absl::StrJoin(t->shape(), ", "),
                                                   "]"));
  }
  return t->dtype() == DType::kF32 ? *t : t->To(DType::kF32);
}

absl::StatusOr<Tensor> ShardedLoader::OutputRows(const std::string& name,
                                                 const std::vector<Range>& ranges,
                                                 bool conv1d) const {
  if (auto q = Quantized(name, ranges, std::nullopt)) return *q;
  auto t = Raw(name);
  if (!t.ok()) return t.status();
  const bool matrix = t->rank() == 2;
  const int dim = matrix && conv1d ? 1 : 0;
  for (const Range& r : ranges) {
    if (r.begin < 0 || r.begin > r.end || r.end > t->dim(dim)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": rows [", r.begin, ", ", r.end,
                                                     ") of ", t->dim(dim), " do not exist"));
    }
  }
  return MaybeQuantizeAtLoad(
      name, Select(*t, dim, ranges, matrix && conv1d, matrix ? dtype_ : DType::kF32));
}

absl::StatusOr<Tensor> ShardedLoader::StackOutputRows(
    const std::vector<std::pair<std::string, Range>>& parts, bool conv1d) const {
  std::vector<Tensor> got;
  for (const auto& [name, range] : parts) {
    auto t = OutputRows(name, {range}, conv1d);
    if (!t.ok()) return t.status();
    got.push_back(*t);
  }
  return got.size() == 1 ? got[0] : ConcatRows(got, parts[0].first, dtype_);
}

absl::StatusOr<Tensor> ShardedLoader::InputColumns(const std::string& name, Range range,
                                                   bool conv1d) const {
  if (auto q = Quantized(name, {}, range)) return *q;
  auto t = Raw(name);
  if (!t.ok()) return t.status();
  if (t->rank() != 2) return absl::InvalidArgumentError(absl::StrCat(name, ": expected 2-D"));
  const int dim = conv1d ? 0 : 1;
  if (range.begin < 0 || range.begin > range.end || range.end > t->dim(dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": columns [", range.begin, ", ", range.end, ") of ", t->dim(dim), " do not exist"));
  }
  // Row-parallel inputs split evenly over the ranks: the checkpoint's must be all of them (a
  // wider weight would otherwise load its first columns).
  if (const int64_t whole = range.size() * layout_.world_size; t->dim(dim) != whole) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", t->dim(dim), " input columns, the config says ", whole));
  }
  if (!conv1d && range.begin == 0 && range.end == t->dim(1)) {
    // Whole: a view when the dtype matches.
    return MaybeQuantizeAtLoad(name, Select(*t, 0, {{0, t->dim(0)}}, false, dtype_));
  }
  const QuantMethod m = w_.quantization().method;
  if (m == QuantMethod::kBnb4AtLoad && range.begin % kBnb4AtLoadBlock == 0 &&
      range.size() % kBnb4AtLoadBlock == 0) {
    // Whole 4-bit blocks: each block's absmax is its own, so this rank's columns quantize
    // alone as they would in the whole rows (not world size times the work at start).
    return MaybeQuantizeAtLoad(name, Select(*t, dim, {range}, conv1d, dtype_));
  }
  if (m == QuantMethod::kInt8AtLoad || m == QuantMethod::kBnb4AtLoad) {
    // Row scales (int8) or blocks (4 bits) from the whole rows, so that every world size
    // quantizes alike.
    const Tensor whole = Select(*t, 0, {{0, t->dim(0)}}, conv1d, dtype_);
    return MaybeQuantizeAtLoad(name, Select(*t, dim, {range}, conv1d, dtype_), &whole, range);
  }
  return Select(*t, dim, {range}, conv1d, dtype_);
}

absl::StatusOr<Tensor> ShardedLoader::VocabRows(const std::string& name) const {
  auto t = Raw(name);
  if (!t.ok()) return t.status();
  if (t->rank() != 2 || t->dim(0) < layout_.vocab.end) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected [", spec_.vocab, ", hidden], got ", t->DebugString()));
  }
  return Select(*t, 0, {layout_.vocab}, false, dtype_);
}

absl::StatusOr<Tensor> ShardedLoader::HeadRows(const std::string& name) const {
  if (auto q = Quantized(name, {layout_.vocab}, std::nullopt)) return *q;
  return VocabRows(name);
}

bool ShardedLoader::Stores(const std::string& name) const {
  if (w_.Has(name)) return true;
  const std::optional<std::string> prefix = LinearPrefix(name);
  return prefix && (w_.Has(*prefix + ".qweight") || w_.Has(*prefix + ".weight_packed"));
}

absl::StatusOr<Tensor> ShardedLoader::FusedQkv(const std::string& name, QkvLayout layout,
                                               bool conv1d) const {
  const int64_t d = spec_.head_dim;
  std::vector<Range> ranges;
  if (layout == QkvLayout::kConcat) {
    const int64_t q = spec_.num_heads * d, kv = spec_.num_kv_heads * d;
    ranges = {q_rows(), kv_rows().Shifted(q), kv_rows().Shifted(q + kv)};
  } else if (layout == QkvLayout::kGrouped) {
    // KV group g (G = heads / KV heads): rows of its G q heads, then its k, then its v.
    const int64_t g = spec_.num_heads / spec_.num_kv_heads, group = (g + 2) * d;
    for (int64_t h = layout_.q_heads.begin; h < layout_.q_heads.end; ++h) {
      ranges.push_back(Range{(h / g) * group + (h % g) * d, (h / g) * group + (h % g + 1) * d});
    }
    for (int64_t part = 0; part < 2; ++part) {
      for (int64_t kv = layout_.kv_heads.begin; kv < layout_.kv_heads.end; ++kv) {
        ranges.push_back(Range{kv * group + (g + part) * d, kv * group + (g + part + 1) * d});
      }
    }
  } else {
    if (spec_.num_kv_heads != spec_.num_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": a per-head fused qkv needs as many KV heads as heads"));
    }
    // Head h's q, k and v are rows [3hD, 3hD + D), [3hD + D, ...), [3hD + 2D, 3hD + 3D).
    for (int part = 0; part < 3; ++part) {
      for (int64_t h = layout_.q_heads.begin; h < layout_.q_heads.end; ++h) {
        ranges.push_back(Range{(3 * h + part) * d, (3 * h + part + 1) * d});
      }
    }
  }
  return OutputRows(name, ranges, conv1d);
}

DecoderSpec MultiHeadSpec(const ModelConfig& c) {
  DecoderSpec s;
  s.hidden = c.hidden_size;
  s.num_layers = c.num_layers;
  s.num_heads = c.num_heads;
  s.num_kv_heads = c.num_heads;
  s.head_dim = c.hidden_size / c.num_heads;
  s.vocab = c.vocab_size;
  return s;
}

absl::Status AssignLoads(TensorLoads* loads) {
  for (auto& [dst, t] : *loads) {
    if (!t.ok()) return t.status();
    *dst = *std::move(t);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CausalLM>> FinishDecoder(const ShardedLoader& loader,
                                                        const WeightStore& weights,
                                                        const std::string& head_name, bool tied,
                                                        DecoderSpec spec, DecoderWeights dw,
                                                        std::shared_ptr<Communicator> comm) {
  const QuantConfig& q = weights.quantization();
  if (tied || !loader.Stores(head_name)) {
    if (q.lm_head_quantized.value_or(false)) {
      // GPTQModel refuses to quantize a head tied to the embedding; nor is there one to read.
      return absl::InvalidArgumentError(absl::StrCat(
          q.source, ": lm_head = true, but ",
          tied ? "the lm_head is tied to the embedding (tie_word_embeddings)"
               : absl::StrCat("the checkpoint has no ", head_name, " nor its quantized tensors")));
    }
    // A tied checkpoint that still stores the head: transformers ties it to the embedding and
    // never reads it, and so do we. (A quantized head left there stays unread: an error.)
    if (weights.Has(head_name)) weights.MarkRead(head_name);
    dw.lm_head = dw.embed;
  } else {
    auto head = loader.HeadRows(head_name);
    if (!head.ok()) return head.status();
    if (q.lm_head_quantized && *q.lm_head_quantized != (head->quantized() != nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          q.source, ": lm_head = ", *q.lm_head_quantized ? "true" : "false", ", but ", head_name,
          *q.lm_head_quantized ? " is stored dense" : " is stored quantized (qweight)"));
    }
    dw.lm_head = *head;
  }
  // A copy when int8 and tied: the embedding stays.
  auto head = loader.LmHead(head_name, dw.lm_head);
  if (!head.ok()) return head.status();
  dw.lm_head = *std::move(head);
  if (auto st = ValidateWeights(spec, loader.layout(), dw); !st.ok()) return st;
  return std::make_unique<CausalLM>(std::move(spec), std::move(dw), std::move(comm));
}

}  // namespace tgis::server

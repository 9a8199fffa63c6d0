// bitsandbytes' 4-bit checkpoints (transformers' save_pretrained of a load_in_4bit model), as
// bitsandbytes writes and reads them (QuantState.as_dict / from_dict, functional.py):
//   P.weight             uint8 [ceil(out * in / 2), 1]: the codes of the row-major [out, in]
//                        weight, two to a byte, the even element in the high nibble
//   P.weight.absmax      one per block of `blocksize` consecutive elements: f32, or with double
//                        quantization uint8 codes of absmax - offset
//   P.weight.quant_map   the 16 values codes stand for (nf4 or fp4), f32
//   P.weight.nested_absmax, P.weight.nested_quant_map   double quantization: the absmax codes'
//                        own absmax per block of nested_blocksize, and their 256-value map
//   P.weight.quant_state.bitsandbytes__nf4 (or __fp4)   uint8 bytes of a JSON record: quant_type,
//                        blocksize, dtype, shape, and nested_blocksize, nested_dtype,
//                        nested_offset where nested
// w = quant_map[code] * absmax[block], absmax = nested_quant_map[q] * nested_absmax[q's block]
// + offset where nested, each product and sum in f32, as bitsandbytes' dequantize_4bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/quantized.h"
#include "server/block_codes.h"
#include "server/config_keys.h"
#include "server/quantization.h"
#include "server/weights.h"

namespace tgis::server {

using Json = nlohmann::json;
using kernels::DType;
using kernels::Tensor;

namespace {

constexpr const char* kQuantStateKey = ".weight.quant_state.bitsandbytes__";

// bitsandbytes' get_4bit_type: its kernels use these tables whatever quant_map a file holds.
std::vector<float> Table(const std::string& type) {
  if (type == "nf4") {
    // Quantiles of N(0, 1) scaled to [-1, 1] (QLoRA), as f32 values; written as doubles so
    // that each rounds to f32 as torch.tensor rounds bitsandbytes' Python floats.
    const double nf4[16] = {-1.0,
                            -0.6961928009986877,
                            -0.5250730514526367,
                            -0.39491748809814453,
                            -0.28444138169288635,
                            -0.18477343022823334,
                            -0.09105003625154495,
                            0.0,
                            0.07958029955625534,
                            0.16093020141124725,
                            0.24611230194568634,
                            0.33791524171829224,
                            0.44070982933044434,
                            0.5626170039176941,
                            0.7229568362236023,
                            1.0};
    return std::vector<float>(nf4, nf4 + 16);
  }
  // fp4 (1 sign, 2 exponent bits, 1 mantissa bit) in code order, divided by its largest
  // magnitude in f32 as get_4bit_type divides it.
  const float fp4[16] = {0, 0.0625f, 8, 12, 4, 6, 2, 3, -0, -0.0625f, -8, -12, -4, -6, -2, -3};
  std::vector<float> t(16);
  for (int i = 0; i < 16; ++i) t[i] = fp4[i] / 12.f;
  return t;
}

bool SameBits(const std::vector<float>& a, const float* b, size_t n) {
  return a.size() == n && std::memcmp(a.data(), b, n * sizeof(float)) == 0;
}

struct QuantState {
  std::string type;  // nf4 or fp4
  int64_t blocksize = 0;
  int64_t out = 0, in = 0;
  bool nested = false;
  int64_t nested_blocksize = 0;
  float nested_offset = 0.f;
};

absl::StatusOr<QuantState> ReadQuantState(const WeightStore& w, const std::string& name,
                                          const std::string& type) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
  };
  auto bytes = w.View(name);
  if (!bytes.ok()) return bytes.status();
  if (bytes->dtype() != DType::kU8 || bytes->rank() != 1) {
    return bad(absl::StrCat("expected 1-D uint8 bytes of JSON, got ", bytes->DebugString()));
  }
  const char* p = static_cast<const char*>(bytes->raw());
  Json j = Json::parse(p, p + bytes->numel(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return bad("not a JSON object");
  using config_keys::IntKey;
  using config_keys::StringKey;
  QuantState s;
  auto qt = StringKey(j, name, "quant_type", "");
  if (!qt.ok()) return qt.status();
  if (*qt != type) return bad(absl::StrCat("quant_type '", *qt, "' in a record named ", type));
  s.type = *qt;
  auto bs = IntKey(j, name, "blocksize", std::nullopt);
  if (!bs.ok()) return bs.status();
  if (*bs <= 0) return bad(absl::StrCat("blocksize = ", *bs));
  s.blocksize = *bs;
  // The dtype the weight had, which bitsandbytes rounds dequantized weights to before its
  // matmul; here they stay f32 (x and the sums are f32), so this reads only its sense.
  auto dtype = StringKey(j, name, "dtype", "");
  if (!dtype.ok()) return dtype.status();
  if (*dtype != "float32" && *dtype != "bfloat16" && *dtype != "float16") {
    return bad(absl::StrCat("dtype '", *dtype, "': expected float32, bfloat16 or float16"));
  }
  auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array() || shape->size() != 2 ||
      !(*shape)[0].is_number_integer() || !(*shape)[1].is_number_integer() ||
      (*shape)[0].get<int64_t>() < 0 || (*shape)[1].get<int64_t>() < 0) {
    return bad(absl::StrCat("shape = ", shape == j.end() ? "missing" : shape->dump(),
                            ": expected [out, in]"));
  }
  s.out = (*shape)[0].get<int64_t>();
  s.in = (*shape)[1].get<int64_t>();
  s.nested = j.contains("nested_blocksize");
  if (s.nested) {
    auto nbs = IntKey(j, name, "nested_blocksize", std::nullopt);
    if (!nbs.ok()) return nbs.status();
    if (*nbs <= 0) return bad(absl::StrCat("nested_blocksize = ", *nbs));
    s.nested_blocksize = *nbs;
    auto ndtype = StringKey(j, name, "nested_dtype", "float32");
    if (!ndtype.ok()) return ndtype.status();
    if (*ndtype != "float32") {
      return bad(absl::StrCat("nested_dtype '", *ndtype, "': expected float32"));
    }
    auto off = j.find("nested_offset");
    if (off == j.end() || !off->is_number() || !std::isfinite(off->get<double>())) {
      return bad("nested_offset: expected a finite number");
    }
    // An f32 (the mean of the absmax) written as a Python float: exact as f32 again.
    s.nested_offset = static_cast<float>(off->get<double>());
  }
  if (auto st = config_keys::CheckKeys(j, name,
                                       {"quant_type", "blocksize", "dtype", "shape",
                                        "nested_blocksize", "nested_dtype", "nested_offset"},
                                       {});
      !st.ok()) {
    return st;
  }
  return s;
}

// A 1-D f32 tensor of `n` values.
absl::StatusOr<Tensor> F32Vector(const WeightStore& w, const std::string& name, int64_t n) {
  auto t = w.View(name);
  if (!t.ok()) return t.status();
  if (t->dtype() != DType::kF32 || t->numel() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected ", n, " f32 values, got ", t->DebugString()));
  }
  return t;
}

// Each block's absmax, dequantized where the checkpoint quantized them.
absl::StatusOr<std::vector<float>> BlockAbsmax(const WeightStore& w, const std::string& prefix,
                                               const QuantState& s, int64_t blocks) {
  const std::string name = prefix + ".weight.absmax";
  std::vector<float> absmax(blocks);
  if (!s.nested) {
    auto a = F32Vector(w, name, blocks);
    if (!a.ok()) return a.status();
    std::memcpy(absmax.data(), a->raw(), blocks * sizeof(float));
  } else {
    auto codes = w.View(name);
    if (!codes.ok()) return codes.status();
    if (codes->dtype() != DType::kU8 || codes->numel() != blocks) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", blocks,
                                                     " uint8 codes (double quantization), got ",
                                                     codes->DebugString()));
    }
    const int64_t nested_blocks = (blocks + s.nested_blocksize - 1) / s.nested_blocksize;
    auto nested = F32Vector(w, prefix + ".weight.nested_absmax", nested_blocks);
    if (!nested.ok()) return nested.status();
    auto map = F32Vector(w, prefix + ".weight.nested_quant_map", 256);
    if (!map.ok()) return map.status();
    const uint8_t* q = codes->data<uint8_t>();
    for (int64_t b = 0; b < blocks; ++b) {
      const float scaled = map->data<float>()[q[b]] * nested->data<float>()[b / s.nested_blocksize];
      absmax[b] = scaled + s.nested_offset;
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    if (!std::isfinite(absmax[b])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": block ", b, "'s absmax is ", absmax[b]));
    }
  }
  return absmax;
}

}  // namespace

std::optional<std::string> Bnb4QuantStateOf(const WeightStore& w, const std::string& prefix) {
  for (const char* type : {"nf4", "fp4"}) {
    const std::string name = absl::StrCat(prefix, kQuantStateKey, type);
    if (w.Has(name)) return name;
  }
  return std::nullopt;
}

absl::StatusOr<Tensor> LoadBnb4Linear(const WeightStore& w, const QuantConfig& q,
                                      const std::string& prefix, const std::vector<Range>& rows,
                                      std::optional<ColumnSlice> cols) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", q.source, ")"));
  };
  const std::optional<std::string> record = Bnb4QuantStateOf(w, prefix);
  if (!record) return bad("no quant_state.bitsandbytes__nf4 or __fp4 record");
  if (w.Has(absl::StrCat(prefix, kQuantStateKey, "nf4")) &&
      w.Has(absl::StrCat(prefix, kQuantStateKey, "fp4"))) {
    return bad("both an nf4 and an fp4 quant_state record");
  }
  const std::string type = record->substr(record->size() - 3);
  auto s = ReadQuantState(w, *record, type);
  if (!s.ok()) return s.status();
  const int64_t out = s->out, in = s->in;
  // The layout here keeps a scale per row and group of columns: blocks that run across rows
  // have no such form.
  if (in % s->blocksize != 0) {
    return bad(absl::StrCat("blocks of ", s->blocksize, " weights run across rows of ", in,
                            " (not a multiple): not supported"));
  }
  auto weight = w.View(prefix + ".weight");
  if (!weight.ok()) return weight.status();
  // (The shape is the record's: bound it by the bytes before multiplying.)
  const bool bounded = in == 0 || out <= 2 * weight->numel() / in;
  if (weight->dtype() != DType::kU8 || !bounded || weight->numel() != (out * in + 1) / 2) {
    return bad(absl::StrCat("weight is ", weight->DebugString(), ": expected ",
                            bounded ? absl::StrCat((out * in + 1) / 2) : "more",
                            " uint8 bytes of 4-bit codes for [", out, ", ", in, "]"));
  }
  const std::vector<float> table = Table(type);
  auto map = F32Vector(w, prefix + ".weight.quant_map", 16);
  if (!map.ok()) return map.status();
  if (!SameBits(table, map->data<float>(), 16)) {
    return bad(absl::StrCat("quant_map differs from bitsandbytes' ", type,
                            " table (which its kernels use whatever the file holds)"));
  }
  const int64_t groups = in / s->blocksize;
  auto absmax = BlockAbsmax(w, prefix, *s, out * groups);
  if (!absmax.ok()) return absmax.status();
  auto slice = SliceOfLinear(prefix, q.source, out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  const uint8_t* packed = weight->data<uint8_t>();
  return BlockCodesWeight(*slice, in, s->blocksize, *absmax, table,
                          [&](int64_t n, int64_t k) -> uint8_t {
                            const int64_t e = n * in + k;
                            return (packed[e / 2] >> (e % 2 == 0 ? 4 : 0)) & 0xF;
                          });
}

absl::StatusOr<Tensor> QuantizeBnb4AtLoad(const Tensor& dense, const std::string& type, Range cols,
                                          const std::string& name) {
  constexpr int64_t kBlock = kBnb4AtLoadBlock;
  const int64_t out = dense.dim(0), in = dense.dim(1);
  if (in % kBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": rows of ", in,
                                                   " weights are not whole blocks of ", kBlock,
                                                   " (--quantize bitsandbytes-", type, ")"));
  }
  const std::vector<float> table = Table(type);
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  int64_t bad_row = -1;
  if (!kernels::QuantizeBlocks4(dense, kBlock, table, &codes, &absmax, &bad_row)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": row ", bad_row,
                                                   " holds a NaN or an infinity, which "
                                                   "--quantize bitsandbytes-",
                                                   type, " cannot hold"));
  }
  LinearSlice all;
  for (int64_t n = 0; n < out; ++n) all.rows.push_back(n);
  all.cols = cols;  // of the whole rows just quantized
  return BlockCodesWeight(all, in, kBlock, absmax, table,
                          [&](int64_t n, int64_t k) { return codes[n * in + k]; });
}

}  // namespace tgis::server

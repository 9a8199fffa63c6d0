#include "server/compressed_tensors.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/quantized.h"
#include "server/config_keys.h"
#include "server/weights.h"

namespace tgis::server {

using config_keys::BoolKey;
using config_keys::CheckKeys;
using config_keys::IntKey;
using config_keys::IsPositivePair;
using config_keys::StringKey;
using Json = nlohmann::json;
using kernels::DType;
using kernels::Tensor;

namespace {

// Top-level keys read nowhere, and why.
const std::set<std::string> kIgnoredKeys = {
    "quant_method",              // read: "compressed-tensors"
    "ignore",                    // modules left dense: read as dense by their tensors
    "global_compression_ratio",  // bookkeeping
    "version",                   // of the library that wrote it
    "quantization_status",       // "compressed" or "frozen": the tensors' dtypes say which
    "provider",
};
// Keys of a quantization args object (weights, input_activations) that only steer
// calibration; the ones that change the stored tensors are read.
const std::set<std::string> kArgsIgnoredKeys = {
    "observer",    "observer_kwargs",  // calibration
    "actorder",                        // read: weight_g_idx says what "group" ordering stored
    "scale_dtype", "zp_dtype",         // the tensors' own dtypes say it
};

// What a config group's weights are.
enum class Kind { kFloat8, kInt };

// A group's weights args: float8 per tensor, channel or block of weights (`block` gets its
// [rows, columns]); integers of 4 or 8 bits per tensor, channel or group (`bits` and
// `group_size` get them: -1 per channel, 0 per tensor).
absl::StatusOr<Kind> CheckWeightArgs(const Json& j, const std::string& where, int* bits,
                                     int64_t* group_size, std::pair<int64_t, int64_t>* block) {
  if (!j.is_object()) return absl::InvalidArgumentError(where + ": expected an object");
  auto num_bits = IntKey(j, where, "num_bits", std::nullopt);
  if (!num_bits.ok()) return num_bits.status();
  auto type = StringKey(j, where, "type", "int");
  if (!type.ok()) return type.status();
  auto strategy = StringKey(j, where, "strategy", "tensor");
  if (!strategy.ok()) return strategy.status();
  const bool float8 = *type == "float" && *num_bits == 8;
  const bool integer = *type == "int" && (*num_bits == 4 || *num_bits == 8);
  if (!float8 && !integer) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": num_bits ", *num_bits, ", type '", *type,
                     "': float8 weights and integer ones of 4 or 8 bits are supported"));
  }
  const std::set<std::string> strategies =
      float8 ? std::set<std::string>{"tensor", "channel", "block"}
             : std::set<std::string>{"tensor", "channel", "group"};
  if (strategies.count(*strategy) == 0) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": strategy '", *strategy, "': ", float8 ? "float8" : "integer",
        " weights per tensor, per channel or per ", float8 ? "block" : "group", " are supported"));
  }
  if (auto symmetric = BoolKey(j, where, "symmetric", true); !symmetric.ok()) {
    return symmetric.status();
  } else if (!*symmetric && float8) {
    return absl::UnimplementedError(absl::StrCat(where, ": symmetric = false is not supported"));
  }
  if (auto dynamic = BoolKey(j, where, "dynamic", false); !dynamic.ok()) {
    return dynamic.status();
  } else if (*dynamic) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": dynamic: dynamically quantized weights are not stored"));
  }
  *block = {0, 0};
  if (auto it = j.find("block_structure"); *strategy == "block") {
    if (it == j.end() || !IsPositivePair(*it)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": block_structure = ", it == j.end() ? "missing" : it->dump(),
                       ": the block strategy needs [rows, columns]"));
    }
    *block = {(*it)[0].get<int64_t>(), (*it)[1].get<int64_t>()};
  } else if (it != j.end() && !it->is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": block_structure = ", it->dump(),
                                                   " with strategy '", *strategy, "'"));
  }
  auto group = IntKey(j, where, "group_size", -1);
  if (!group.ok()) return group.status();
  if (*strategy == "group") {
    if (*group <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": group_size = ", *group, ": the group strategy needs one > 0"));
    }
    *group_size = *group;
  } else if (*group > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": group_size = ", *group, " with strategy '", *strategy, "'"));
  } else {
    *group_size = *strategy == "channel" ? -1 : 0;
  }
  if (auto it = j.find("actorder"); it != j.end() && !it->is_null() && *it != false) {
    static const std::set<std::string> kOrders = {"weight", "static", "group", "dynamic"};
    if (float8 || !it->is_string() || kOrders.count(it->get<std::string>()) == 0) {
      return absl::UnimplementedError(absl::StrCat(where, ": actorder = ", it->dump()));
    }
  }
  *bits = static_cast<int>(*num_bits);
  if (auto st = CheckKeys(
          j, where,
          {"num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure"},
          kArgsIgnoredKeys);
      !st.ok()) {
    return st;
  }
  return float8 ? Kind::kFloat8 : Kind::kInt;
}

// A group's input_activations: 8-bit integers or floats, static or dynamic. Activations stay
// in the compute dtype here (weight-only), so their scheme is checked, not applied.
absl::Status CheckActivationArgs(const Json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(where + ": expected an object");
  auto num_bits = IntKey(j, where, "num_bits", std::nullopt);
  if (!num_bits.ok()) return num_bits.status();
  auto type = StringKey(j, where, "type", "int");
  if (!type.ok()) return type.status();
  if (*num_bits != 8 || (*type != "int" && *type != "float")) {
    return absl::UnimplementedError(absl::StrCat(where, ": num_bits ", *num_bits, ", type '", *type,
                                                 "': 8-bit activation schemes are supported"));
  }
  if (auto v = StringKey(j, where, "strategy", ""); !v.ok()) return v.status();
  for (const char* key : {"symmetric", "dynamic"}) {
    if (auto v = BoolKey(j, where, key, false); !v.ok()) return v.status();
  }
  if (auto group = IntKey(j, where, "group_size", -1); !group.ok()) return group.status();
  return CheckKeys(
      j, where,
      {"num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure"},
      kArgsIgnoredKeys);
}

// The formats that store each kind (a group's own "format" overrides the config's).
absl::Status CheckFormat(const std::string& format, Kind kind, const std::string& where) {
  static const std::set<std::string> kFloat = {"float-quantized", "naive-quantized"};
  static const std::set<std::string> kInt = {"pack-quantized", "int-quantized", "naive-quantized"};
  if ((kind == Kind::kFloat8 ? kFloat : kInt).count(format) == 0) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": format '", format, "' for ", kind == Kind::kFloat8 ? "float8" : "integer",
        " weights: float-quantized and naive-quantized float8, pack-quantized, int-quantized "
        "and naive-quantized integers are supported"));
  }
  return absl::OkStatus();
}

// Rows [0, out) of a tensor of int32 words holding `bits`-bit fields along its columns (element
// k of row n at bit k * bits of the row's words) or, `along_rows`, along its rows (element n
// of column g at bit n * bits of column g's words).
uint32_t PackedField(const Tensor& words, int bits, bool along_rows, int64_t n, int64_t k) {
  const int per = 32 / bits;
  const int64_t word_row = along_rows ? n / per : n, word_col = along_rows ? k : k / per;
  const int slot = static_cast<int>(along_rows ? n % per : k % per);
  const auto word =
      static_cast<uint32_t>(words.data<int32_t>()[word_row * words.dim(1) + word_col]);
  return (word >> (bits * slot)) & ((1u << bits) - 1);
}

}  // namespace

absl::StatusOr<QuantConfig> ParseCompressedTensors(const Json& j, const std::string& where) {
  QuantConfig q;
  q.source = where;
  auto format = StringKey(j, where, "format", "");
  if (!format.ok()) return format.status();
  auto groups = j.find("config_groups");
  if (groups == j.end() || !groups->is_object() || groups->empty()) {
    return absl::InvalidArgumentError(where + ": config_groups: expected a non-empty object");
  }
  std::optional<Kind> kind;
  std::set<int> bits;
  std::set<int64_t> group_sizes;
  std::set<std::pair<int64_t, int64_t>> blocks;
  for (const auto& [name, group] : groups->items()) {
    const std::string at = absl::StrCat(where, ": config_groups: ", name);
    if (!group.is_object()) return absl::InvalidArgumentError(at + ": expected an object");
    auto it = group.find("weights");
    if (it == group.end() || it->is_null()) {
      return absl::InvalidArgumentError(at + ": weights: missing");
    }
    int b = 0;
    int64_t g = 0;
    std::pair<int64_t, int64_t> block;
    auto k = CheckWeightArgs(*it, at + ": weights", &b, &g, &block);
    if (!k.ok()) return k.status();
    blocks.insert(block);
    if (kind && *kind != *k) {
      return absl::UnimplementedError(
          at + ": float8 and integer weights in one checkpoint are not supported");
    }
    kind = *k;
    bits.insert(b);
    group_sizes.insert(g);
    if (auto a = group.find("input_activations"); a != group.end() && !a->is_null()) {
      if (auto st = CheckActivationArgs(*a, at + ": input_activations"); !st.ok()) return st;
    }
    if (auto o = group.find("output_activations"); o != group.end() && !o->is_null()) {
      return absl::UnimplementedError(at +
                                      ": output_activations: quantized outputs are not "
                                      "supported");
    }
    auto f = StringKey(group, at, "format", *format);
    if (!f.ok()) return f.status();
    if (auto st = CheckFormat(*f, *k, at); !st.ok()) return st;
    // targets: which modules the scheme was applied to; each linear's tensors say it here.
    if (auto st =
            CheckKeys(group, at, {"weights", "input_activations", "output_activations", "format"},
                      {"targets"});
        !st.ok()) {
      return st;
    }
  }
  if (*format != "mixed-precision") {
    if (auto st = CheckFormat(*format, *kind, where); !st.ok()) return st;
  }
  // moe_sparsity_config (compressed-tensors 0.20, written null by default): experts pruned or
  // collapsed per layer.
  for (const char* key :
       {"kv_cache_scheme", "transform_config", "sparsity_config", "moe_sparsity_config"}) {
    if (auto it = j.find(key); it != j.end() && !it->is_null() && !it->empty()) {
      return absl::UnimplementedError(
          absl::StrCat(where, ": ", key, " = ", it->dump(), ": not supported"));
    }
  }
  if (auto st = CheckKeys(j, where,
                          {"format", "config_groups", "kv_cache_scheme", "transform_config",
                           "sparsity_config", "moe_sparsity_config"},
                          kIgnoredKeys);
      !st.ok()) {
    return st;
  }
  if (*kind == Kind::kFloat8) {
    q.method = QuantMethod::kFp8;
    q.bits = 8;
    if (blocks.size() != 1) {
      return absl::UnimplementedError(
          where + ": config groups with different float8 blocks are not supported");
    }
    std::tie(q.block_rows, q.block_cols) = *blocks.begin();
    return q;
  }
  q.method = QuantMethod::kCompressedInt;
  q.bits = bits.size() == 1 ? *bits.begin() : 0;
  q.group_size = group_sizes.size() == 1 ? *group_sizes.begin() : 0;
  return q;
}

absl::StatusOr<Tensor> LoadCompressedIntLinear(const WeightStore& w, const QuantConfig& q,
                                               const std::string& prefix,
                                               const std::vector<Range>& rows,
                                               std::optional<ColumnSlice> cols) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", q.source, ")"));
  };
  // The codes: packed into int32 words (weight_packed, its shape beside it) or one int8 each.
  const bool packed = w.Has(prefix + ".weight_packed");
  auto codes_t = w.View(prefix + (packed ? ".weight_packed" : ".weight"));
  if (!codes_t.ok()) return codes_t.status();
  if (codes_t->rank() != 2 || codes_t->dtype() != (packed ? DType::kI32 : DType::kI8)) {
    return bad(absl::StrCat(packed ? "weight_packed must be 2-D int32" : "weight must be 2-D int8",
                            ", got ", codes_t->DebugString()));
  }
  const int64_t out = codes_t->dim(0);
  int64_t in = codes_t->dim(1);
  int bits = 8;  // int8 codes, whatever num_bits bounded them to
  if (packed) {
    auto shape = w.Get(prefix + ".weight_shape", DType::kI64);
    if (!shape.ok()) return shape.status();
    if (shape->numel() != 2 || shape->data<int64_t>()[0] != out) {
      return bad(absl::StrCat("weight_shape is ", shape->DebugString(), " for weight_packed ",
                              codes_t->DebugString()));
    }
    in = shape->data<int64_t>()[1];
    // Words per row: ceil(in * bits / 32).
    const int64_t words = codes_t->dim(1);
    bits = words == (in * 4 + 31) / 32 ? 4 : words == (in * 8 + 31) / 32 ? 8 : 0;
    if (bits == 0) {
      return bad(absl::StrCat("weight_packed ", codes_t->DebugString(), " for weight_shape [", out,
                              ", ", in, "]: not ", in, " columns of 4 or 8 bits"));
    }
    if (q.bits != 0 && bits != q.bits) {
      return bad(
          absl::StrCat("weight_packed holds ", bits, "-bit codes, the config says ", q.bits));
    }
  }
  const int32_t offset = 1 << (bits - 1);  // stored unsigned: code = q + offset
  auto scale = w.Get(prefix + ".weight_scale", DType::kF32);
  if (!scale.ok()) return scale.status();
  // Per tensor: [1] or [1, 1]; per row or group: [out, groups].
  const bool per_tensor = scale->numel() == 1 && (scale->rank() < 2 || scale->dim(0) == 1);
  const int64_t groups = per_tensor ? 1 : scale->rank() == 2 ? scale->dim(1) : 0;
  if (!per_tensor && (scale->rank() != 2 || scale->dim(0) != out || groups <= 0)) {
    return bad(absl::StrCat("weight_scale is ", scale->DebugString(), " for ", out, " rows"));
  }
  int64_t group_size = groups == 1 ? in : q.group_size > 0 ? q.group_size : 0;
  if (group_size == 0 && in % groups == 0) group_size = in / groups;  // the config's differ
  if (group_size <= 0 || (in + group_size - 1) / group_size != groups) {
    return bad(absl::StrCat(groups, " groups of scales for ", in, " columns",
                            q.group_size > 0 ? absl::StrCat(" in groups of ", q.group_size) : ""));
  }
  // Zero points (asymmetric): signed, packed along the output rows like the codes in packed
  // checkpoints' row and group scales, else int8 (or wider) as is.
  std::optional<Tensor> zp;
  bool zp_packed = false;
  if (w.Has(prefix + ".weight_zero_point")) {
    auto z = w.View(prefix + ".weight_zero_point");
    if (!z.ok()) return z.status();
    zp_packed = packed && !per_tensor;
    if (zp_packed) {
      if (z->dtype() != DType::kI32 || z->rank() != 2 || z->dim(0) != (out * bits + 31) / 32 ||
          z->dim(1) != groups) {
        return bad(absl::StrCat("weight_zero_point must be int32 [", (out * bits + 31) / 32, ", ",
                                groups, "] (packed along the rows), got ", z->DebugString()));
      }
      zp = *z;
    } else {
      auto zi = w.Get(prefix + ".weight_zero_point", DType::kI64);
      if (!zi.ok()) return zi.status();
      if (zi->numel() != (per_tensor ? 1 : out * groups)) {
        return bad(absl::StrCat("weight_zero_point is ", zi->DebugString(), " for ",
                                per_tensor ? int64_t{1} : out * groups, " scales"));
      }
      zp = *zi;
    }
  }
  std::vector<int32_t> g_idx(in);
  if (w.Has(prefix + ".weight_g_idx")) {  // actorder "group": each column's group
    auto g = w.Get(prefix + ".weight_g_idx", DType::kI64);
    if (!g.ok()) return g.status();
    if (g->numel() != in) return bad(absl::StrCat("weight_g_idx is ", g->DebugString()));
    for (int64_t k = 0; k < in; ++k) {
      const int64_t v = g->data<int64_t>()[k];
      if (v < 0 || v >= groups) {
        return bad(absl::StrCat("weight_g_idx[", k, "] = ", v, " is not a group of ", groups));
      }
      g_idx[k] = static_cast<int32_t>(v);
    }
  } else {
    for (int64_t k = 0; k < in; ++k) g_idx[k] = static_cast<int32_t>(k / group_size);
  }
  // Static activation scales (W8A8's input_scale and input_zero_point): activations are not
  // quantized here.
  for (const char* unused : {".input_scale", ".input_zero_point"}) {
    if (w.Has(prefix + unused)) w.MarkRead(prefix + unused);
  }
  auto slice = SliceOfLinear(prefix, q.source, out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  const Range c = slice->cols;
  const std::vector<int64_t>& picked = slice->rows;
  const int64_t nsel = static_cast<int64_t>(picked.size()), kc = c.size();
  std::vector<uint8_t> codes(nsel * kc);
  std::vector<float> sc(nsel * groups), zs(nsel * groups);
  const int8_t* int8_codes = packed ? nullptr : codes_t->data<int8_t>();
  for (int64_t i = 0; i < nsel; ++i) {
    const int64_t n = picked[i];
    for (int64_t k = c.begin; k < c.end; ++k) {
      codes[i * kc + (k - c.begin)] =
          packed ? static_cast<uint8_t>(PackedField(*codes_t, bits, false, n, k))
                 : static_cast<uint8_t>(int8_codes[n * in + k] + offset);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale->data<float>()[per_tensor ? 0 : n * groups + g];
      if (!std::isfinite(s)) return bad(absl::StrCat("weight_scale[", n, ", ", g, "] = ", s));
      int64_t z = 0;  // signed, as q
      if (zp && zp_packed) {
        z = static_cast<int64_t>(PackedField(*zp, bits, true, n, g)) - offset;
      } else if (zp) {
        z = zp->data<int64_t>()[per_tensor ? 0 : n * groups + g];
      }
      if (z < -offset || z >= offset) {
        return bad(absl::StrCat("weight_zero_point[", n, ", ", g, "] = ", z, " is not a ", bits,
                                "-bit integer"));
      }
      sc[i * groups + g] = s;
      zs[i * groups + g] = static_cast<float>(z + offset);
    }
  }
  std::vector<int32_t> group(g_idx.begin() + c.begin, g_idx.begin() + c.end);
  return Tensor::Quantized(std::make_shared<const kernels::QuantizedWeight>(
      kernels::BuildQuantized(bits, nsel, kc, codes, group, groups, sc, zs)));
}

}  // namespace tgis::server

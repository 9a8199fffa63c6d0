#include "server/quantization.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/quantized.h"
#include "server/auto_round.h"
#include "server/compressed_tensors.h"
#include "server/config_keys.h"
#include "server/weights.h"

namespace tgis::server {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using kernels::DType;
using kernels::Tensor;

using config_keys::BoolKey;
using config_keys::CheckKeys;
using config_keys::IntKey;
using config_keys::IsPositivePair;
using config_keys::RejectIfTrue;
using config_keys::StringKey;

namespace {

// Keys of a GPTQ config that only steer how the checkpoint was made (calibration, kernels the
// quantizer's own runtime picks): nothing a server reads. Keys not here and not read below
// are errors, so a new meaning cannot pass unnoticed.
const std::set<std::string> kGptqIgnoredKeys = {
    "quant_method",         // read: "gptq"
    "damp_percent",         // calibration dampening
    "damp_auto_increment",  // calibration
    "true_sequential",      // calibration order
    "static_groups",        // how groups were chosen; g_idx records the result
    "model_name_or_path",   // bookkeeping
    "model_file_base_name",
    "meta",  // quantizer name and version
    "mse",   // calibration search
    "dataset", "tokenizer", "batch_size", "cache_block_outputs", "max_input_length",
    "module_name_preceding_first_block", "modules_in_block_to_quantize",  // which modules got
    // quantized: we read each linear by what its tensors are (qweight, or a dense weight)
    "block_name_to_quantize",  // transformers' GPTQConfig: likewise
    "model_seqlen",            // calibration sequence length
    "hyb_act",                 // GPTQModel's hybrid act-order: g_idx records the order
    "act_group_aware",         // transformers' group-aware act-order (GAR): likewise
    "pad_token_id", "use_cuda_fp16", "use_exllama", "disable_exllama", "exllama_config", "backend",
    "quantizer", "device", "adapter",  // the quantizer's runtime
};
const std::set<std::string> kAwqIgnoredKeys = {
    "quant_method",            // read: "awq"
    "zero_point",              // read
    "modules_to_not_convert",  // dense modules: read as dense by their tensors
    "backend",
    "do_fuse",
    "fuse_max_seq_len",
    "modules_to_fuse",
    "exllama_config",  // AutoAWQ's and transformers' runtime choices
    "meta",            // GPTQModel's: quantizer name, version, calibration
};

// Keys GPTQModel (2025-2026) writes into GPTQ and AWQ configs alike, read the same way for
// both: `method` and `format` repeat quant_method and checkpoint_format; `pack_dtype` is the
// integer type the codes are packed in; `rotation` says the weights were rotated (QuaRot-style)
// and need an online Hadamard transform at run time. `name` is the method ("gptq", "awq");
// `format` the checkpoint format the config names otherwise.
absl::Status CheckGptqModelKeys(const Json& j, const std::string& where, const std::string& name,
                                const std::string& format) {
  auto method = StringKey(j, where, "method", name);
  if (!method.ok()) return method.status();
  if (*method != name) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": method '", *method, "' but quant_method '", name, "'"));
  }
  auto fmt = StringKey(j, where, "format", format);
  if (!fmt.ok()) return fmt.status();
  if (*fmt != format) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": format '", *fmt, "' but checkpoint format '", format, "'"));
  }
  auto pack = StringKey(j, where, "pack_dtype", "int32");
  if (!pack.ok()) return pack.status();
  if (*pack != "int32") {
    return absl::UnimplementedError(absl::StrCat(where, ": pack_dtype '", *pack,
                                                 "': codes packed in int32 words are supported"));
  }
  auto rotation = StringKey(j, where, "rotation", "");
  if (!rotation.ok()) return rotation.status();
  if (!rotation->empty()) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": rotation '", *rotation,
        "': rotated checkpoints need an online Hadamard transform this server does not apply"));
  }
  if (auto it = j.find("dynamic"); it != j.end() && !it->is_null() && !it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dynamic = ", it->dump(), ": expected an object"));
  }
  return absl::OkStatus();  // dynamic's rules are read in the file's order by ReadQuantConfig
}
const std::set<std::string> kGptqModelKeys = {"method", "format", "pack_dtype", "rotation",
                                              "dynamic"};

const std::set<std::string> kFbgemmIgnoredKeys = {
    "quant_method",         // read: "fbgemm_fp8"
    "activation_scale_ub",  // bound on dynamic fp8 activation scales: activations stay unquantized
    "modules_to_not_convert",  // dense modules: read as dense by their tensors
};

absl::StatusOr<QuantConfig> ParseGptq(const Json& j, const std::string& where) {
  QuantConfig q;
  q.method = QuantMethod::kGptq;
  q.source = where;
  auto bits = IntKey(j, where, "bits", std::nullopt);
  if (!bits.ok()) return bits.status();
  if (*bits != 4 && *bits != 8) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": bits = ", *bits, ": GPTQ with 4 or 8 bits is supported"));
  }
  q.bits = static_cast<int>(*bits);
  auto group = config_keys::GroupSizeKey(j, where);
  if (!group.ok()) return group.status();
  q.group_size = *group;
  // desc_act and sym change the tensors (g_idx order, zero points), not how they are read:
  // the tensors say it all. They are still checked for type.
  for (const char* key : {"desc_act", "sym"}) {
    if (auto b = BoolKey(j, where, key, false); !b.ok()) return b.status();
  }
  // GPTQModel writes the format under both names; either alone says it.
  auto format =
      StringKey(j, where, "checkpoint_format",
                j.contains("format") && j["format"].is_string() ? j["format"].get<std::string>()
                                                                : std::string("gptq"));
  if (!format.ok()) return format.status();
  if (auto st = CheckGptqModelKeys(j, where, "gptq", *format); !st.ok()) return st;
  if (*format != "gptq" && *format != "gptq_v2") {
    return absl::UnimplementedError(absl::StrCat(where, ": checkpoint_format '", *format,
                                                 "' (gptq and gptq_v2 are supported)"));
  }
  q.zero_minus_one = *format == "gptq";
  if (auto st = RejectIfTrue(j, where, "is_marlin_format",
                             "Marlin-repacked GPTQ checkpoints are not supported");
      !st.ok()) {
    return st;
  }
  // GPTQModel's lm_head = true: the head is quantized too (its qweight, qzeros, scales, g_idx).
  auto head = BoolKey(j, where, "lm_head", false);
  if (!head.ok()) return head.status();
  q.lm_head_quantized = *head;
  std::set<std::string> read = {
      "bits", "group_size", "desc_act", "sym", "checkpoint_format", "is_marlin_format", "lm_head"};
  read.insert(kGptqModelKeys.begin(), kGptqModelKeys.end());
  // AutoRound's GPTQ exports carry its own keys too.
  if (auto st = CheckAutoRoundKeys(j, where); !st.ok()) return st;
  std::set<std::string> ignored = kGptqIgnoredKeys;
  ignored.insert(AutoRoundKeys().begin(), AutoRoundKeys().end());
  if (auto st = CheckKeys(j, where, read, ignored); !st.ok()) return st;
  return q;
}

absl::StatusOr<QuantConfig> ParseAwq(const Json& j, const std::string& where) {
  QuantConfig q;
  q.method = QuantMethod::kAwq;
  q.source = where;
  auto bits = IntKey(j, where, j.contains("w_bit") ? "w_bit" : "bits", std::nullopt);
  if (!bits.ok()) return bits.status();
  if (*bits != 4) {
    return absl::UnimplementedError(absl::StrCat(where, ": bits = ", *bits, ": AWQ is 4-bit"));
  }
  q.bits = 4;
  auto group = config_keys::GroupSizeKey(
      j, where, j.contains("q_group_size") ? "q_group_size" : "group_size");
  if (!group.ok()) return group.status();
  q.group_size = *group;
  auto zero = BoolKey(j, where, "zero_point", true);
  if (!zero.ok()) return zero.status();
  if (!*zero) {
    return absl::UnimplementedError(absl::StrCat(where, ": zero_point = false is not supported"));
  }
  // GPTQModel's AWQ configs say sym (= !zero_point) too.
  if (auto sym = BoolKey(j, where, "sym", !*zero); !sym.ok()) {
    return sym.status();
  } else if (*sym == *zero) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": sym = ", *sym ? "true" : "false", " contradicts zero_point"));
  }
  // The packing: AutoAWQ's version, GPTQModel's format and checkpoint_format (all alike).
  std::string version = "gemm";
  for (const char* key : {"version", "checkpoint_format", "format"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    auto v = StringKey(j, where, key, "");
    if (!v.ok()) return v.status();
    std::transform(v->begin(), v->end(), v->begin(), ::tolower);
    if (*v != "gemm") {
      return absl::UnimplementedError(
          absl::StrCat(where, ": ", key, " '", *v, "': only AutoAWQ's GEMM packing is supported"));
    }
  }
  if (auto st = CheckGptqModelKeys(j, where, "awq", version); !st.ok()) return st;
  if (auto st = RejectIfTrue(j, where, "desc_act", "AWQ with act-order is not supported");
      !st.ok()) {
    return st;
  }
  if (auto st = RejectIfTrue(j, where, "lm_head", "a quantized AWQ lm_head is not supported");
      !st.ok()) {
    return st;
  }
  std::set<std::string> read = {"bits",       "w_bit",  "group_size", "q_group_size",
                                "zero_point", "sym",    "version",    "checkpoint_format",
                                "desc_act",   "lm_head"};
  read.insert(kGptqModelKeys.begin(), kGptqModelKeys.end());
  // AutoRound's AWQ exports carry its own keys too.
  if (auto st = CheckAutoRoundKeys(j, where); !st.ok()) return st;
  std::set<std::string> ignored = kAwqIgnoredKeys;
  ignored.insert(AutoRoundKeys().begin(), AutoRoundKeys().end());
  if (auto st = CheckKeys(j, where, read, ignored); !st.ok()) return st;
  return q;
}

absl::StatusOr<QuantConfig> ParseFbgemmFp8(const Json& j, const std::string& where) {
  QuantConfig q;
  q.method = QuantMethod::kFp8;
  q.bits = 8;
  q.source = where;
  if (auto st = CheckKeys(j, where, {}, kFbgemmIgnoredKeys); !st.ok()) return st;
  return q;
}

// transformers' fine-grained fp8 (FineGrainedFP8Config: DeepSeek-V3's and Qwen3's FP8
// checkpoints): float8 e4m3 weights with a factor per block of weights (weight_scale_inv).
absl::StatusOr<QuantConfig> ParseFineGrainedFp8(const Json& j, const std::string& where) {
  QuantConfig q;
  q.method = QuantMethod::kFp8;
  q.bits = 8;
  q.source = where;
  q.fp8_scale = ".weight_scale_inv";
  auto scheme = StringKey(j, where, "activation_scheme", "dynamic");
  if (!scheme.ok()) return scheme.status();
  if (*scheme != "dynamic" && *scheme != "static") {  // activations are not quantized here
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": activation_scheme '", *scheme, "': expected dynamic or static"));
  }
  auto fmt = StringKey(j, where, "fmt", "e4m3");
  if (!fmt.ok()) return fmt.status();
  if (*fmt != "e4m3") {
    return absl::UnimplementedError(
        absl::StrCat(where, ": fmt '", *fmt, "': float8 e4m3 weights are supported"));
  }
  if (auto it = j.find("weight_block_size"); it == j.end()) {
    q.block_rows = q.block_cols = 128;  // transformers' default
  } else if (!it->is_null()) {
    if (!IsPositivePair(*it)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": weight_block_size = ", it->dump(),
                                                     ": expected two positive integers"));
    }
    q.block_rows = (*it)[0].get<int64_t>();
    q.block_cols = (*it)[1].get<int64_t>();
  }
  // modules_to_not_convert: dense modules, read as dense by their tensors; dequantize: whether
  // transformers itself dequantizes at load (a choice of its runtime).
  if (auto st = CheckKeys(j, where, {"activation_scheme", "fmt", "weight_block_size"},
                          {"quant_method", "modules_to_not_convert", "dequantize"});
      !st.ok()) {
    return st;
  }
  return q;
}

// transformers' BitsAndBytesConfig of a checkpoint saved from a load_in_8bit model. Its keys
// that steer LLM.int8's runtime (the outlier threshold, which modules stayed dense, offload)
// change nothing here: activations stay f32, so there are no outliers to split off, and each
// linear's tensors say whether it is int8. Of a load_in_4bit checkpoint the tensors say the
// rest too (each linear's quant_state record: nf4 or fp4, block size, double quantization),
// as bitsandbytes reads them back; the config's 4-bit keys are checked for sense only.
absl::StatusOr<QuantConfig> ParseBitsandbytes(const Json& j, const std::string& where) {
  bool in_8bit = false, in_4bit = false;
  for (const char* key : {"load_in_8bit", "_load_in_8bit", "load_in_4bit", "_load_in_4bit"}) {
    auto b = BoolKey(j, where, key, false);
    if (!b.ok()) return b.status();
    (std::string(key).find("8bit") != std::string::npos ? in_8bit : in_4bit) |= *b;
  }
  if (in_4bit && in_8bit) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": load_in_8bit and load_in_4bit are both true"));
  }
  if (!in_8bit && !in_4bit) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": neither load_in_8bit nor load_in_4bit is true"));
  }
  auto type = StringKey(j, where, "bnb_4bit_quant_type", "fp4");
  if (!type.ok()) return type.status();
  if (*type != "nf4" && *type != "fp4") {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": bnb_4bit_quant_type '", *type, "': expected nf4 or fp4"));
  }
  // Other storage dtypes (FSDP's bfloat16) hold the same bytes under another tensor dtype.
  auto storage = StringKey(j, where, "bnb_4bit_quant_storage", "uint8");
  if (!storage.ok()) return storage.status();
  if (in_4bit && *storage != "uint8") {
    return absl::UnimplementedError(absl::StrCat(where, ": bnb_4bit_quant_storage '", *storage,
                                                 "': uint8 storage is supported"));
  }
  if (auto st =
          RejectIfTrue(j, where, "llm_int8_has_fp16_weight",
                       "LLM.int8 with f16 master weights (a training setup) is not supported");
      !st.ok()) {
    return st;
  }
  if (auto st =
          CheckKeys(j, where,
                    {"load_in_8bit", "_load_in_8bit", "load_in_4bit", "_load_in_4bit",
                     "llm_int8_has_fp16_weight", "bnb_4bit_quant_type", "bnb_4bit_quant_storage"},
                    {"quant_method",
                     "llm_int8_threshold",     // LLM.int8's outlier split: x stays f32 here
                     "llm_int8_skip_modules",  // dense modules: read as dense by tensors
                     "llm_int8_enable_fp32_cpu_offload",  // placement
                     // whether the absmax are quantized too: each linear's tensors say
                     "bnb_4bit_use_double_quant",
                     // the dtype bitsandbytes multiplies 4-bit weights in: x and the
                     // sums stay f32 here
                     "bnb_4bit_compute_dtype"});
      !st.ok()) {
    return st;
  }
  QuantConfig q;
  q.method = in_4bit ? QuantMethod::kBnb4 : QuantMethod::kBnbInt8;
  q.bits = in_4bit ? 4 : 8;
  q.source = where;
  return q;
}

// Element i (flat) of an int32 tensor.
int32_t I32At(const Tensor& t, int64_t i) { return t.data<int32_t>()[i]; }

absl::StatusOr<Tensor> Tensor2D(const WeightStore& w, const std::string& name, DType want) {
  auto t = w.View(name);
  if (!t.ok()) return t.status();
  if (t->rank() != 2) return absl::InvalidArgumentError(absl::StrCat(name, ": expected 2-D"));
  if (want == DType::kI32) {
    if (t->dtype() != DType::kI32) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected int32, got ", kernels::DTypeName(t->dtype())));
    }
    return t;
  }
  return w.Get(name, want);
}

// transformers' Mxfp4Config as the gpt-oss checkpoints carry it. modules_to_not_convert: dense
// modules, read as dense by their tensors (only experts hold *_blocks); dequantize: whether
// transformers dequantizes to bf16 at load, a choice of its runtime: we serve the codes as they
// are (server/mxfp4.cc), which equals the dequantized experts up to summation order.
absl::StatusOr<QuantConfig> ParseMxfp4(const Json& j, const std::string& where) {
  if (auto st = CheckKeys(j, where, {}, {"quant_method", "modules_to_not_convert", "dequantize"});
      !st.ok()) {
    return st;
  }
  QuantConfig q;
  q.method = QuantMethod::kMxfp4;
  q.bits = 4;
  q.group_size = 32;
  return q;
}

// A config by its quant_method (AutoGPTQ's quantize_config.json may leave it out: gptq).
absl::StatusOr<QuantConfig> ParseQuantization(const Json& j, const std::string& where) {
  auto method = StringKey(j, where, "quant_method", "gptq");
  if (!method.ok()) return method.status();
  absl::StatusOr<QuantConfig> q =
      *method == "gptq"                 ? ParseGptq(j, where)
      : *method == "awq"                ? ParseAwq(j, where)
      : *method == "compressed-tensors" ? ParseCompressedTensors(j, where)
      : *method == "fbgemm_fp8"         ? ParseFbgemmFp8(j, where)
      : *method == "fp8"                ? ParseFineGrainedFp8(j, where)
      : *method == "bitsandbytes"       ? ParseBitsandbytes(j, where)
      : *method == "mxfp4"              ? ParseMxfp4(j, where)
      : *method == "auto-round" || *method == "intel/auto-round"
          ? ParseAutoRound(j, where)
          : absl::UnimplementedError(
                absl::StrCat(where, ": quant_method '", *method,
                             "' is not supported (gptq, awq, compressed-tensors, fbgemm_fp8, fp8, "
                             "bitsandbytes, mxfp4 and auto-round are)"));
  if (q.ok()) q->quant_method = *method;
  return q;
}

// GPTQModel's dynamic rules of a GPTQ or AWQ config, in `file`'s order.
absl::Status ReadDynamic(const fs::path& file, const std::string& object_key,
                         const std::string& where, QuantConfig* q) {
  if (q->method != QuantMethod::kGptq && q->method != QuantMethod::kAwq) return absl::OkStatus();
  if (q->quant_method == "auto-round" || q->quant_method == "intel/auto-round") {
    auto rules = ReadAutoRoundRules(file, object_key, where, *q);
    if (!rules.ok()) return rules.status();
    q->dynamic = *std::move(rules);
    return absl::OkStatus();
  }
  DynamicRuleKeys keys;
  keys.bits = q->method == QuantMethod::kGptq ? std::set<int>{4, 8} : std::set<int>{4};
  keys.tensor_led = {"sym", "desc_act"};
  keys.ignored = kGptqIgnoredKeys;
  auto rules = ReadDynamicRules(file, object_key, where, keys);
  if (!rules.ok()) return rules.status();
  q->dynamic = *std::move(rules);
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& QuantizeFlagValues() {
  static const std::vector<std::string> v = {
      "gptq", "bitsandbytes", "bitsandbytes-nf4",   "bitsandbytes-fp4",
      "awq",  "fp8",          "compressed-tensors", "auto-round",
      "mxfp4"};
  return v;
}

absl::StatusOr<QuantConfig> ReadQuantConfig(const std::string& model_dir, const ModelConfig& c,
                                            const std::optional<std::string>& flag) {
  if (flag && std::find(QuantizeFlagValues().begin(), QuantizeFlagValues().end(), *flag) ==
                  QuantizeFlagValues().end()) {
    return absl::InvalidArgumentError(absl::StrCat("--quantize '", *flag, "': expected one of ",
                                                   absl::StrJoin(QuantizeFlagValues(), ", ")));
  }
  QuantConfig found;
  const std::string config_file = (fs::path(model_dir) / "config.json").string();
  const fs::path gptq_file = fs::path(model_dir) / "quantize_config.json";
  if (auto it = c.raw.find("quantization_config"); it != c.raw.end() && !it->is_null()) {
    const std::string where = config_file + ": quantization_config";
    if (!it->is_object()) return absl::InvalidArgumentError(where + ": expected an object");
    auto q = ParseQuantization(*it, where);
    if (!q.ok()) return q.status();
    found = *q;
    if (auto st = ReadDynamic(config_file, "quantization_config", where, &found); !st.ok()) {
      return st;
    }
  } else if (std::error_code ec; fs::exists(gptq_file, ec)) {
    auto j = ReadJsonObject(gptq_file, /*required=*/true);
    if (!j.ok()) return j.status();
    auto q = ParseQuantization(*j, gptq_file.string());
    if (!q.ok()) return q.status();
    found = *q;
    if (auto st = ReadDynamic(gptq_file, "", gptq_file.string(), &found); !st.ok()) return st;
  }
  if (!flag) return found;
  const bool prequantized = found.method != QuantMethod::kNone;
  if (*flag == "bitsandbytes") {
    // quantized by bitsandbytes itself
    if (found.method == QuantMethod::kBnbInt8 || found.method == QuantMethod::kBnb4) return found;
    if (prequantized) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quantize bitsandbytes: the checkpoint is already quantized (", found.source, ")"));
    }
    QuantConfig q;
    q.method = QuantMethod::kInt8AtLoad;
    q.bits = 8;
    q.source = "--quantize bitsandbytes";
    return q;
  }
  if (*flag == "bitsandbytes-nf4" || *flag == "bitsandbytes-fp4") {
    if (found.method == QuantMethod::kBnb4) return found;  // bitsandbytes' own 4-bit codes
    if (prequantized) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quantize ", *flag, ": the checkpoint is already quantized (", found.source, ")"));
    }
    QuantConfig q;
    q.method = QuantMethod::kBnb4AtLoad;
    q.bits = 4;
    q.bnb4_type = flag->substr(flag->size() - 3);
    q.source = "--quantize " + *flag;
    return q;
  }
  // fp8: float8 weights of any origin; compressed-tensors and auto-round: any scheme of that
  // format (vLLM's --quantization values; AutoRound's older exports say intel/auto-round).
  const bool matches = *flag == "gptq"         ? found.method == QuantMethod::kGptq
                       : *flag == "awq"        ? found.method == QuantMethod::kAwq
                       : *flag == "fp8"        ? found.method == QuantMethod::kFp8
                       : *flag == "mxfp4"      ? found.method == QuantMethod::kMxfp4
                       : *flag == "auto-round" ? found.quant_method == "auto-round" ||
                                                     found.quant_method == "intel/auto-round"
                                               : found.quant_method == "compressed-tensors";
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--quantize ", *flag, ": ", model_dir,
        prequantized ? absl::StrCat(" is quantized otherwise (", found.source, ")")
                     : " has no quantization config (config.json quantization_config or "
                       "quantize_config.json): quantize the checkpoint first"));
  }
  return found;
}

absl::StatusOr<LinearSlice> SliceOfLinear(const std::string& prefix, const std::string& source,
                                          int64_t out, int64_t in, const std::vector<Range>& rows,
                                          std::optional<ColumnSlice> cols) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", source, ")"));
  };
  LinearSlice s;
  if (cols && cols->whole != in) {
    return bad(absl::StrCat(in, " input columns, the config says ", cols->whole));
  }
  s.cols = cols ? cols->range : Range{0, in};
  if (s.cols.begin < 0 || s.cols.begin > s.cols.end || s.cols.end > in) {
    return bad(
        absl::StrCat("columns [", s.cols.begin, ", ", s.cols.end, ") of ", in, " do not exist"));
  }
  for (const Range& r : rows.empty() ? std::vector<Range>{{0, out}} : rows) {
    if (r.begin < 0 || r.begin > r.end || r.end > out) {
      return bad(absl::StrCat("rows [", r.begin, ", ", r.end, ") of ", out, " do not exist"));
    }
    for (int64_t n = r.begin; n < r.end; ++n) s.rows.push_back(n);
  }
  return s;
}

absl::StatusOr<Tensor> LoadQuantizedLinear(const WeightStore& w, const QuantConfig& q,
                                           const std::string& prefix,
                                           const std::vector<Range>& rows,
                                           std::optional<ColumnSlice> cols) {
  const bool awq = q.method == QuantMethod::kAwq;
  const DynamicRule* rule = MatchDynamicRule(q.dynamic, prefix);
  if (rule != nullptr && rule->excluded) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ": stored quantized, but the dynamic rule '", rule->key,
                     "' leaves it unquantized (", q.source, ")"));
  }
  const int bits = rule && rule->bits ? *rule->bits : q.bits, pack = 32 / bits;
  const int64_t config_group = rule && rule->group_size ? *rule->group_size : q.group_size;
  const uint32_t mask = (1u << bits) - 1;
  auto qweight = Tensor2D(w, prefix + ".qweight", DType::kI32);
  auto qzeros = Tensor2D(w, prefix + ".qzeros", DType::kI32);
  auto scales = Tensor2D(w, prefix + ".scales", DType::kF32);
  if (!qweight.ok()) return qweight.status();
  if (!qzeros.ok()) return qzeros.status();
  if (!scales.ok()) return scales.status();
  const int64_t in = awq ? qweight->dim(0) : qweight->dim(0) * pack;
  const int64_t out = awq ? qweight->dim(1) * pack : qweight->dim(1);
  const int64_t groups = scales->dim(0);
  const int64_t group_size = config_group == -1 ? in : config_group;
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", q.source, ")"));
  };
  if (scales->dim(1) != out)
    return bad(absl::StrCat("scales has ", scales->dim(1), " columns, qweight ", out));
  // Exactly the words `out` zeros take (as every packer writes them): codes of other bits
  // than the config says (a rule that does not match the tensors) fail here, not read as
  // another width.
  if (qzeros->dim(0) != groups || qzeros->dim(1) != (out + pack - 1) / pack) {
    return bad(absl::StrCat("qzeros is ", qzeros->DebugString(), " for ", groups, " groups of ",
                            out, " outputs"));
  }
  if (groups != (in + group_size - 1) / group_size) {
    return bad(
        absl::StrCat(groups, " groups of scales for ", in, " inputs in groups of ", group_size));
  }
  std::vector<int32_t> g_idx(in);
  if (!awq && w.Has(prefix + ".g_idx")) {
    auto g = w.View(prefix + ".g_idx");
    if (!g.ok()) return g.status();
    if (g->dtype() != DType::kI32 || g->numel() != in) {
      return bad(absl::StrCat("g_idx must be int32 [", in, "], got ", g->DebugString()));
    }
    for (int64_t k = 0; k < in; ++k) {
      g_idx[k] = I32At(*g, k);
      if (g_idx[k] < 0 || g_idx[k] >= groups) {
        return bad(absl::StrCat("g_idx[", k, "] = ", g_idx[k], " is not a group of ", groups));
      }
    }
  } else {
    for (int64_t k = 0; k < in; ++k) g_idx[k] = static_cast<int32_t>(k / group_size);
  }
  auto slice = SliceOfLinear(prefix, q.source, out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  const Range c = slice->cols;
  const std::vector<int64_t>& picked = slice->rows;
  // AWQ packs eight outputs per int32 in the order 0 2 4 6 1 3 5 7: output 8j + o sits in
  // nibble kAwqNibble[o].
  static constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  // pack is 8 or 4: shifts and masks, not divisions, in the loops below.
  const int pack_shift = bits == 4 ? 3 : 2;
  auto packed_along_out = [&](const Tensor& t, int64_t row, int64_t n) -> uint32_t {
    const uint32_t word = static_cast<uint32_t>(I32At(t, row * t.dim(1) + (n >> pack_shift)));
    const int slot = static_cast<int>(n & (pack - 1));
    return (word >> (bits * (awq ? kAwqNibble[slot] : slot))) & mask;
  };
  const int64_t nsel = static_cast<int64_t>(picked.size()), kc = c.size();
  std::vector<uint8_t> codes(nsel * kc);
  std::vector<int32_t> group(g_idx.begin() + c.begin, g_idx.begin() + c.end);
  std::vector<float> sc(nsel * groups), zs(nsel * groups);
  // Tiles of 16 output rows, so that the words read (both layouts pack neighbouring outputs
  // into neighbouring words) stay in cache while every code of theirs is taken: row by row,
  // GPTQ's qweight [in / pack, out] was walked down its columns, a cache line per word, and
  // the unpacking took most of a GPTQ checkpoint's load.
  constexpr int64_t kRowTile = 16;
  for (int64_t i0 = 0; i0 < nsel; i0 += kRowTile) {
    const int64_t i1 = std::min(nsel, i0 + kRowTile);
    if (!awq) {
      // GPTQ: a word holds `pack` columns of one output; each word read once, its codes
      // written in a row. The words a few rows of qweight on are prefetched: the walk strides
      // `out` words, which the hardware does not follow (the loads missed to DRAM in turn).
      const int32_t* qw = qweight->data<int32_t>();
      const int64_t words = qweight->dim(0);
      for (int64_t kw = c.begin >> pack_shift; kw << pack_shift < c.end; ++kw) {
        if (kw + 4 < words) {
          __builtin_prefetch(&qw[(kw + 4) * out + picked[i0]]);
          __builtin_prefetch(&qw[(kw + 4) * out + picked[i1 - 1]]);
        }
        const int64_t k0 = std::max(kw << pack_shift, c.begin);
        const int64_t k1 = std::min((kw + 1) << pack_shift, c.end);
        for (int64_t i = i0; i < i1; ++i) {
          const uint32_t word = static_cast<uint32_t>(qw[kw * out + picked[i]]);
          uint8_t* dst = codes.data() + i * kc;  // this row's codes, column c.begin first
          for (int64_t k = k0; k < k1; ++k) {
            dst[k - c.begin] = static_cast<uint8_t>((word >> (bits * (k & (pack - 1)))) & mask);
          }
        }
      }
    } else {
      for (int64_t k = c.begin; k < c.end; ++k) {
        for (int64_t i = i0; i < i1; ++i) {
          codes[i * kc + (k - c.begin)] =
              static_cast<uint8_t>(packed_along_out(*qweight, k, picked[i]));
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = picked[i];
        sc[i * groups + g] = scales->data<float>()[g * out + n];
        zs[i * groups + g] =
            static_cast<float>(packed_along_out(*qzeros, g, n) + (q.zero_minus_one ? 1 : 0));
      }
    }
  }
  auto built = std::make_shared<const kernels::QuantizedWeight>(
      kernels::BuildQuantized(bits, nsel, kc, codes, group, groups, sc, zs));
  return Tensor::Quantized(std::move(built));
}

absl::StatusOr<Tensor> LoadFp8Linear(const WeightStore& w, const QuantConfig& q,
                                     const std::string& prefix, const std::vector<Range>& rows,
                                     std::optional<ColumnSlice> cols) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", q.source, ")"));
  };
  auto weight = w.View(prefix + ".weight", /*fp8_ok=*/true);
  if (!weight.ok()) return weight.status();
  if (weight->rank() != 2 || weight->dtype() != DType::kF8E4M3) {
    return bad(
        absl::StrCat("weight must be a 2-D float8 e4m3 tensor, got ", weight->DebugString()));
  }
  const int64_t out = weight->dim(0), in = weight->dim(1);
  auto scale_f = w.Get(prefix + q.fp8_scale, DType::kF32);
  if (!scale_f.ok()) return scale_f.status();
  // Scales per block of [block_rows, block_cols] weights: row n, column group g has the scale
  // of block (n / block_rows, g); else one per tensor or row (groups of all columns).
  const bool blocks = q.block_rows > 0;
  const int64_t block_cols = blocks ? q.block_cols : in;
  const int64_t groups = blocks ? (in + block_cols - 1) / block_cols : 1;
  if (blocks) {
    const int64_t block_rows = (out + q.block_rows - 1) / q.block_rows;
    if (scale_f->rank() != 2 || scale_f->dim(0) != block_rows || scale_f->dim(1) != groups) {
      return bad(absl::StrCat(q.fp8_scale.substr(1), " is ", scale_f->DebugString(), ": expected [",
                              block_rows, ", ", groups, "] for blocks of [", q.block_rows, ", ",
                              q.block_cols, "] weights"));
    }
  } else if (scale_f->numel() != 1 && scale_f->numel() != out) {
    return bad(absl::StrCat(q.fp8_scale.substr(1), " is ", scale_f->DebugString(),
                            ": expected one scale or ", out, " (one per output row)"));
  }
  auto scale_of = [&](int64_t n, int64_t g) {
    if (blocks) return scale_f->data<float>()[(n / q.block_rows) * groups + g];
    return scale_f->data<float>()[scale_f->numel() == 1 ? 0 : n];
  };
  // Static activation scales for fp8 GEMMs (compressed-tensors' input_scale, FBGEMM's
  // input_scale_ub): activations are not quantized here.
  for (const char* unused : {".input_scale", ".input_scale_ub"}) {
    if (w.Has(prefix + unused)) w.MarkRead(prefix + unused);
  }
  auto slice = SliceOfLinear(prefix, q.source, out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  const Range c = slice->cols;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  const uint8_t* src = static_cast<const uint8_t*>(weight->raw());
  for (const int64_t n : slice->rows) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale_of(n, g);
      if (!std::isfinite(s)) {
        return bad(
            absl::StrCat(q.fp8_scale.substr(1), " of row ", n, ", column group ", g, " = ", s));
      }
      scales.push_back(s);
    }
    for (int64_t k = c.begin; k < c.end; ++k) {
      const uint8_t v = src[n * in + k];
      if ((v & 0x7F) == 0x7F) return bad(absl::StrCat("weight[", n, ", ", k, "] is NaN"));
      codes.push_back(v);
    }
  }
  const int64_t nsel = static_cast<int64_t>(scales.size()) / groups;
  std::vector<int32_t> group(c.size());
  for (int64_t k = c.begin; k < c.end; ++k) {
    group[k - c.begin] = static_cast<int32_t>(k / block_cols);
  }
  return Tensor::Quantized(std::make_shared<const kernels::QuantizedWeight>(
      kernels::BuildFp8(nsel, c.size(), codes, group, groups, scales)));
}

absl::StatusOr<Tensor> LoadBnbInt8Linear(const WeightStore& w, const QuantConfig& q,
                                         const std::string& prefix, const std::vector<Range>& rows,
                                         std::optional<ColumnSlice> cols) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", what, " (", q.source, ")"));
  };
  auto weight = w.View(prefix + ".weight");
  if (!weight.ok()) return weight.status();
  if (weight->rank() != 2 || weight->dtype() != DType::kI8) {
    return bad(
        absl::StrCat("weight must be a 2-D int8 tensor beside SCB, got ", weight->DebugString()));
  }
  const int64_t out = weight->dim(0), in = weight->dim(1);
  auto scb = w.Get(prefix + ".SCB", DType::kF32);
  if (!scb.ok()) return scb.status();
  if (scb->numel() != out) {
    return bad(
        absl::StrCat("SCB is ", scb->DebugString(), ": expected one absmax per row of ", out));
  }
  // bitsandbytes reads weight_format 0 ("row") only, and writes nothing else since 0.43.
  if (w.Has(prefix + ".weight_format")) {
    auto format = w.Get(prefix + ".weight_format", DType::kI64);
    if (!format.ok()) return format.status();
    if (format->numel() != 1 || format->data<int64_t>()[0] != 0) {
      return bad(absl::StrCat("weight_format is ", format->DebugString(),
                              ": only 0 (row-major) is a layout bitsandbytes reads"));
    }
  }
  auto slice = SliceOfLinear(prefix, q.source, out, in, rows, cols);
  if (!slice.ok()) return slice.status();
  const Range c = slice->cols;
  const int64_t nsel = static_cast<int64_t>(slice->rows.size()), kc = c.size();
  std::vector<uint8_t> codes(nsel * kc);
  std::vector<float> scales(nsel);
  const int8_t* src = weight->data<int8_t>();
  for (int64_t i = 0; i < nsel; ++i) {
    const int64_t n = slice->rows[i];
    const float absmax = scb->data<float>()[n];
    if (!std::isfinite(absmax) || absmax < 0.f) return bad(absl::StrCat("SCB[", n, "] = ", absmax));
    // bitsandbytes' int8_vectorwise_dequant: weight * SCB * 7.874015718698502e-3, the constant
    // an f32 (1/127); one scale per row here, so the product rounds once less.
    scales[i] = absmax * 7.874015718698502e-3f;
    for (int64_t k = 0; k < kc; ++k) {
      codes[i * kc + k] = static_cast<uint8_t>(src[n * in + c.begin + k] + 128);
    }
  }
  return Tensor::Quantized(std::make_shared<const kernels::QuantizedWeight>(
      kernels::BuildQuantized(8, nsel, kc, codes, std::vector<int32_t>(kc, 0), 1, scales,
                              std::vector<float>(nsel, 128.f))));
}

}  // namespace tgis::server

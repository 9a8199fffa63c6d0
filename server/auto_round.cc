#include "server/auto_round.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "server/config_keys.h"

namespace tgis::server {

namespace {

using config_keys::BoolKey;
using config_keys::CheckKeys;
using config_keys::IntKey;
using config_keys::StringKey;
using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Keys of an AutoRound scheme (the config's, or an extra_config entry's) that only steered
// the quantizer, or that a weight-only server does not apply.
const std::set<std::string> kSchemeIgnored = {
    // Activation quantization (act_bits < 16: W4A8 and the like): activations stay in the
    // compute dtype here, more exact than the checkpoint's own kernels.
    "act_bits", "act_data_type", "act_group_size", "act_sym", "act_dynamic"};

// What a layer's packed codes are, by packing_format (or its older name `backend`).
struct Packing {
  QuantMethod method;
  bool zero_minus_one;  // AutoGPTQ's v1 zeros (stored zero - 1)
};

absl::StatusOr<Packing> PackingOf(const Json& j, const std::string& where) {
  std::string format = "auto_round:auto_gptq";  // AutoRound's reader's default
  const char* key = "packing_format";
  if (j.contains("packing_format") && !j["packing_format"].is_null()) {
    auto v = StringKey(j, where, key, format);
    if (!v.ok()) return v.status();
    format = *v;
  } else if (j.contains("backend") && j["backend"].is_string() &&
             j["backend"].get<std::string>().rfind("auto_round", 0) == 0) {
    key = "backend";  // before AutoRound 0.5 (2025) the packing went by this name
    format = j["backend"].get<std::string>();
  }
  static const std::map<std::string, Packing> kPackings = {
      // AutoGPTQ's layout: qweight packed along the input, zeros stored minus 1, no g_idx.
      {"auto_round:auto_gptq", {QuantMethod::kGptq, true}},
      {"auto_round:gptq", {QuantMethod::kGptq, true}},
      {"auto_round:gptq:exllamav2", {QuantMethod::kGptq, true}},  // before 2025
      // AutoRound's own: the same layout with zeros as they are (GPTQModel's v2).
      {"auto_round", {QuantMethod::kGptq, false}},
      {"auto_round:gptqmodel", {QuantMethod::kGptq, false}},
      {"auto_round:exllamav2", {QuantMethod::kGptq, false}},  // before 2025
      {"auto_round:triton", {QuantMethod::kGptq, false}},     // before 2025
      // AutoAWQ's GEMM layout.
      {"auto_round:auto_awq", {QuantMethod::kAwq, false}},
      {"auto_round:awq", {QuantMethod::kAwq, false}},
  };
  auto it = kPackings.find(format);
  if (it == kPackings.end()) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": ", key, " '", format,
                     "': AutoRound's integer packings (auto_round, auto_round:auto_gptq, "
                     "auto_round:gptqmodel, auto_round:auto_awq) are supported"));
  }
  return it->second;
}

// A scheme's data type: integer codes (the default), or, for a layer left in 16 bits, a float.
absl::Status CheckDataType(const Json& j, const std::string& where, bool unquantized) {
  auto type = StringKey(j, where, "data_type", "int");
  if (!type.ok()) return type.status();
  if (*type == "int" || (unquantized && (*type == "fp" || *type == "float"))) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      absl::StrCat(where, ": data_type '", *type,
                   "': AutoRound's integer codes are supported (its mx_fp, nv_fp and fp8 "
                   "exports are not)"));
}

// Keys that must be absent or null: each would change how the weights are read.
absl::Status RejectSet(const Json& j, const std::string& where,
                       const std::map<std::string, std::string>& keys) {
  for (const auto& [key, why] : keys) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null() || (it->is_object() && it->empty()) ||
        (it->is_array() && it->empty())) {
      continue;
    }
    return absl::UnimplementedError(
        absl::StrCat(where, ": ", key, " = ", it->dump(), ": ", why, " is not supported"));
  }
  return absl::OkStatus();
}

const std::map<std::string, std::string> kRejected = {
    {"super_bits", "double quantization of the scales (GGUF's k-quants)"},
    {"super_group_size", "double quantization of the scales (GGUF's k-quants)"},
    {"rotation_configs", "rotated weights (an online Hadamard transform)"},
    {"rotation_config", "rotated weights (an online Hadamard transform)"},
    {"static_kv_dtype", "a quantized KV cache"},
    {"static_attention_dtype", "quantized attention"},
    // The exporter merges it into extra_config; left apart, its rules would go unread.
    {"regex_config", "regex_config outside extra_config"},
};

absl::StatusOr<DynamicRule> ReadRule(const std::string& key, const OrderedJson& value, bool exact,
                                     const std::string& where, const QuantConfig& q) {
  const std::string at = absl::StrCat(where, ": extra_config '", key, "'");
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, " = ", value.dump(), ": expected an object"));
  }
  const Json j = Json::parse(value.dump());
  DynamicRule rule;
  rule.key = key;
  rule.search = !exact;
  // An exact layer name as a pattern that matches only itself.
  std::string pattern = key;
  if (exact) {
    pattern.clear();
    for (char c : key) {
      if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) pattern += '\\';
      pattern += c;
    }
    pattern += '$';
  }
  try {
    rule.pattern = std::make_shared<const std::regex>(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ": not a regular expression this server reads (ECMAScript syntax): ", e.what()));
  }
  auto bits = IntKey(j, at, "bits", q.bits);
  if (!bits.ok()) return bits.status();
  rule.excluded = *bits >= 16;
  if (auto st = CheckDataType(j, at, rule.excluded); !st.ok()) return st;
  if (auto st = RejectSet(j, at, kRejected); !st.ok()) return st;
  if (!rule.excluded) {
    const int most = q.method == QuantMethod::kAwq ? 4 : 8;
    if (*bits != 4 && *bits != most) {
      return absl::UnimplementedError(absl::StrCat(
          at, ": bits = ", *bits, ": ", most == 4 ? "4" : "4 or 8", " bits are supported here"));
    }
    if (j.contains("bits")) rule.bits = static_cast<int>(*bits);
    if (j.contains("group_size")) {
      auto group = config_keys::GroupSizeKey(j, at);
      if (!group.ok()) return group.status();
      rule.group_size = *group;
    }
  }
  // sym changes the stored zeros, which the tensors hold.
  if (auto b = BoolKey(j, at, "sym", false); !b.ok()) return b.status();
  std::set<std::string> ignored = kSchemeIgnored;
  for (const auto& [k, why] : kRejected) ignored.insert(k);
  if (auto st = CheckKeys(j, at, {"bits", "group_size", "sym", "data_type"}, ignored); !st.ok()) {
    return st;
  }
  return rule;
}

}  // namespace

const std::set<std::string>& AutoRoundKeys() {
  static const std::set<std::string> keys = [] {
    std::set<std::string> k = kSchemeIgnored;
    for (const auto& [key, why] : kRejected) k.insert(key);
    k.insert({
        "data_type",  // read: "int"
        // The calibration: nothing a server reads.
        "autoround_version", "iters", "lr", "minmax_lr", "nsamples", "seqlen", "batch_size", "amp",
        "gradient_accumulate_steps", "low_gpu_mem_usage", "enable_minmax_tuning",
        "enable_norm_bias_tuning", "enable_quanted_input", "scale_dtype", "model_free", "dataset",
        "quant_block_list", "supported_types",
        // Which blocks were quantized: each linear is read by what its tensors are.
        "to_quant_block_names", "block_name_to_quantize",
        // Granularity of a static KV cache or attention quantization, which static_kv_dtype
        // and static_attention_dtype (refused when set) would ask for.
        "static_kv_granularity", "static_attention_granularity",
        "provider",  // its GPTQ exports: "auto-round"
    });
    return k;
  }();
  return keys;
}

absl::Status CheckAutoRoundKeys(const Json& j, const std::string& where) {
  if (auto st = CheckDataType(j, where, /*unquantized=*/false); !st.ok()) return st;
  return RejectSet(j, where, kRejected);
}

absl::StatusOr<QuantConfig> ParseAutoRound(const Json& j, const std::string& where) {
  auto packing = PackingOf(j, where);
  if (!packing.ok()) return packing.status();
  if (auto st = CheckAutoRoundKeys(j, where); !st.ok()) return st;
  QuantConfig q;
  q.method = packing->method;
  q.zero_minus_one = packing->zero_minus_one;
  q.source = where;
  auto bits = IntKey(j, where, "bits", std::nullopt);
  if (!bits.ok()) return bits.status();
  if (*bits != 4 && (*bits != 8 || q.method == QuantMethod::kAwq)) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": bits = ", *bits, ": AutoRound's ",
        q.method == QuantMethod::kAwq ? "AWQ packing with 4 bits is" : "4 and 8 bits are",
        " supported"));
  }
  q.bits = static_cast<int>(*bits);
  auto group = config_keys::GroupSizeKey(j, where);
  if (!group.ok()) return group.status();
  q.group_size = *group;
  // sym changes the stored zeros (AutoRound's symmetric codes use the full range, with a scale
  // of either sign), which the tensors hold.
  if (auto b = BoolKey(j, where, "sym", true); !b.ok()) return b.status();
  // backend: before 2025 the packing (read above); since, the kernels AutoRound's own runtime
  // should pick.
  if (auto st = CheckKeys(j, where, {"bits", "group_size", "sym", "packing_format", "extra_config"},
                          [] {
                            std::set<std::string> k = AutoRoundKeys();
                            k.insert({"quant_method", "backend", "vllm_backend"});
                            return k;
                          }());
      !st.ok()) {
    return st;
  }
  if (auto it = j.find("extra_config"); it != j.end() && !it->is_null() && !it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": extra_config = ", it->dump(), ": expected an object"));
  }
  return q;  // extra_config's rules are read in the file's order by ReadAutoRoundRules
}

absl::StatusOr<std::vector<DynamicRule>> ReadAutoRoundRules(const std::filesystem::path& file,
                                                            const std::string& object_key,
                                                            const std::string& where,
                                                            const QuantConfig& q) {
  auto extra = ReadInFileOrder(file, object_key, "extra_config");
  if (!extra.ok()) return extra.status();
  if (extra->is_null()) return std::vector<DynamicRule>{};
  if (!extra->is_object()) {  // (ParseAutoRound checked it first)
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": extra_config = ", extra->dump(), ": expected an object"));
  }
  // Every key first as an exact layer name, then every key as a pattern, in the file's order.
  std::vector<DynamicRule> rules;
  for (bool exact : {true, false}) {
    for (const auto& [key, value] : extra->items()) {
      auto rule = ReadRule(key, value, exact, where, q);
      if (!rule.ok()) return rule.status();
      rules.push_back(*std::move(rule));
    }
  }
  return rules;
}

}  // namespace tgis::server

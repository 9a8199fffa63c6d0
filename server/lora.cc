#include "server/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/model_config.h"
#include "server/torch_file.h"
#include "server/weights.h"

namespace tgis::server {
namespace {

namespace fs = std::filesystem;
using kernels::DType;
using kernels::Tensor;
using Json = nlohmann::json;

absl::Status Bad(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

// adapter_config.json keys that change what the adapter computes and that we serve only at
// their defaults (a value other than the default is refused by name).
struct Unserved {
  const char* key;
  Json default_value;
  const char* what;
};
const Unserved kUnserved[] = {
    {"use_dora", false, "DoRA adapters are not served"},
    {"bias", "none", "adapters that train biases are not served"},
    {"lora_bias", false, "adapters with a bias on lora_B are not served"},
    {"modules_to_save", nullptr, "adapters that replace whole modules are not served"},
    {"rank_pattern", Json::object(), "per-module ranks are not served"},
    {"alpha_pattern", Json::object(), "per-module alphas are not served"},
    {"layers_to_transform", nullptr, "adapters of some layers only are not served"},
    {"layers_pattern", nullptr, "adapters of some layers only are not served"},
    {"layer_replication", nullptr, "layer replication is not served"},
    {"trainable_token_indices", nullptr, "trainable tokens are not served"},
    {"use_qalora", false, "QA-LoRA adapters are not served"},
};

// Keys read below: peft_type, r, lora_alpha, use_rslora. Keys that do not change what a saved
// adapter computes, accepted as they are: where it came from and how it was trained
// (base_model_name_or_path, revision, task_type, inference_mode, auto_mapping, peft_version,
// lora_dropout, init_lora_weights, loftq_config, eva_config, corda_config, megatron_config,
// megatron_core, runtime_config), which modules it adapts (target_modules, exclude_modules: the
// saved tensors say, and each is checked against the model), and fan_in_fan_out (GPT-2's
// Conv1D storage; the saved A and B are [r, in] and [out, r] either way), qalora_group_size
// (read only with use_qalora, refused above). Any other key (a newer PEFT's option) is accepted
// only at a null, false or empty value.
const char* const kBookkeeping[] = {"base_model_name_or_path",
                                    "revision",
                                    "task_type",
                                    "inference_mode",
                                    "auto_mapping",
                                    "peft_version",
                                    "lora_dropout",
                                    "init_lora_weights",
                                    "loftq_config",
                                    "eva_config",
                                    "corda_config",
                                    "megatron_config",
                                    "megatron_core",
                                    "runtime_config",
                                    "target_modules",
                                    "exclude_modules",
                                    "fan_in_fan_out",
                                    "peft_type",
                                    "r",
                                    "lora_alpha",
                                    "use_rslora",
                                    "qalora_group_size"};

bool IsDefault(const Json& v, const Json& default_value) {
  if (v.is_null()) return true;
  if (default_value.is_object() || default_value.is_null()) {
    return (v.is_object() || v.is_array()) && v.empty();
  }
  return v == default_value;
}

// A tensor's module and which of A and B it is, from PEFT's saved name.
struct SavedName {
  std::string module;
  bool is_a = false;
};
std::optional<SavedName> ParseName(const std::string& name) {
  const absl::string_view kPrefix = "base_model.model.";
  if (!absl::StartsWith(name, kPrefix)) return std::nullopt;
  for (const auto& [suffix, is_a] :
       {std::pair<absl::string_view, bool>{".lora_A.weight", true}, {".lora_B.weight", false}}) {
    if (absl::EndsWith(name, suffix)) {
      return SavedName{name.substr(kPrefix.size(), name.size() - kPrefix.size() - suffix.size()),
                       is_a};
    }
  }
  return std::nullopt;
}

// Columns `cols` of a [rows, n] f32 tensor, contiguous.
Tensor Columns(const Tensor& t, Range cols) {
  Tensor out = Tensor::Empty({t.dim(0), cols.size()}, DType::kF32);
  for (int64_t r = 0; r < t.dim(0); ++r) {
    std::memcpy(out.data<float>() + r * cols.size(), t.data<float>() + r * t.dim(1) + cols.begin,
                sizeof(float) * cols.size());
  }
  return out;
}

// One part of a fused linear: the module, its rows of the whole module's output that this
// rank holds, and where they go in the fused output.
struct Part {
  std::string module;
  Range rows;
  int64_t at = 0;
  int64_t whole = 0;  // the module's output rows
};

}  // namespace

size_t LoraWeights::bytes() const {
  size_t n = 0;
  for (const LoraLayer& l : layers) {
    for (const LoraPair* p : {&l.qkv, &l.o, &l.up, &l.down}) {
      if (p->defined()) n += p->a.nbytes() + p->b.nbytes();
    }
  }
  return n;
}

std::optional<Json> LoraAdapterConfig(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / "adapter_config.json", ec)) return std::nullopt;
  auto config = ReadJsonObject(dir / "adapter_config.json", /*required=*/true);
  if (!config.ok() || config->value("peft_type", Json()) != "LORA") return std::nullopt;
  return *std::move(config);
}

absl::StatusOr<LoraAdapter> ReadLoraAdapter(const fs::path& dir, const std::string& name) {
  auto config = ReadJsonObject(dir / "adapter_config.json", /*required=*/true);
  if (!config.ok()) return Bad(name + "/adapter_config.json", "not a JSON object");
  return ReadLoraAdapter(dir, name, *config);
}

absl::StatusOr<LoraAdapter> ReadLoraAdapter(const fs::path& dir, const std::string& name,
                                            const Json& config_json) {
  const std::string config_file = name + "/adapter_config.json";
  const Json* config = &config_json;
  if (config->value("peft_type", Json()) != "LORA") {
    return Bad(config_file, "peft_type is not \"LORA\"");
  }
  for (const Unserved& u : kUnserved) {
    if (config->contains(u.key) && !IsDefault((*config)[u.key], u.default_value)) {
      return Bad(config_file, absl::StrCat(u.key, " is ", (*config)[u.key].dump(), ": ", u.what));
    }
  }
  for (const auto& item : config->items()) {
    const std::string& key = item.key();
    const Json& value = item.value();
    const bool known = std::any_of(std::begin(kBookkeeping), std::end(kBookkeeping),
                                   [&](const char* k) { return key == k; }) ||
                       std::any_of(std::begin(kUnserved), std::end(kUnserved),
                                   [&](const Unserved& u) { return key == u.key; });
    const bool unset =
        value.is_null() || value == false ||
        ((value.is_object() || value.is_array() || value.is_string()) && value.empty());
    if (!known && !unset) {
      return Bad(config_file, absl::StrCat(key, " is ", value.dump(),
                                           ": not a LoRA option this server knows (a newer "
                                           "PEFT's?); refused rather than ignored"));
    }
  }
  LoraAdapter a;
  a.name = name;
  const Json r = config->value("r", Json(8)), alpha = config->value("lora_alpha", Json(8));
  if (!r.is_number_integer() || r.get<int64_t>() <= 0) {
    return Bad(config_file, absl::StrCat("r is ", r.dump(), ", not a positive integer"));
  }
  if (!alpha.is_number() || !std::isfinite(alpha.get<double>())) {
    return Bad(config_file, absl::StrCat("lora_alpha is ", alpha.dump(), ", not a number"));
  }
  a.rank = r.get<int64_t>();
  const Json rslora = config->value("use_rslora", Json(false));
  if (!rslora.is_boolean()) return Bad(config_file, "use_rslora is not a boolean");
  // PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rank-stabilized LoRA.
  a.scale = static_cast<float>(alpha.get<double>() / (rslora.get<bool>()
                                                          ? std::sqrt(static_cast<double>(a.rank))
                                                          : static_cast<double>(a.rank)));

  // safetensors first, as PEFT loads them; a .bin (safe_serialization=False) if that is all
  // there is, read by our unpickler, which executes nothing.
  std::error_code ec;
  std::string file = name + "/adapter_model.safetensors";
  std::map<std::string, Tensor> tensors;
  if (fs::is_regular_file(dir / "adapter_model.safetensors", ec)) {
    auto read = ReadSafetensorsFile((dir / "adapter_model.safetensors").string());
    if (!read.ok()) return Bad(file, "not a readable safetensors file");
    tensors = *std::move(read);
  } else if (fs::is_regular_file(dir / "adapter_model.bin", ec)) {
    file = name + "/adapter_model.bin";
    auto read = ReadTorchFile((dir / "adapter_model.bin").string());
    if (!read.ok()) return Bad(file, "not a readable PyTorch file");
    for (const auto& [key, t] : *read) {
      auto f = ToFloatTensor(t, DType::kF32, absl::StrCat(file, ": ", key));
      if (!f.ok()) return f.status();
      tensors.emplace(key, *std::move(f));
    }
  } else {
    return Bad(name, "no adapter_model.safetensors or adapter_model.bin");
  }
  std::map<std::string, std::pair<std::optional<Tensor>, std::optional<Tensor>>> found;
  for (const auto& [key, t] : tensors) {
    std::optional<SavedName> n = ParseName(key);
    if (!n) {
      return Bad(file, absl::StrCat("tensor ", key,
                                    " is not a LoRA A or B weight (embedding adapters, DoRA "
                                    "magnitudes and saved modules are not served)"));
    }
    if (t.rank() != 2) return Bad(file, absl::StrCat(key, ": expected 2-D"));
    const int64_t rank_dim = n->is_a ? t.dim(0) : t.dim(1);
    if (rank_dim != a.rank) {
      return Bad(file,
                 absl::StrCat(key, ": rank ", rank_dim, ", adapter_config.json's r is ", a.rank));
    }
    auto& slot = n->is_a ? found[n->module].first : found[n->module].second;
    slot = t.To(DType::kF32);
  }
  for (auto& [module, ab] : found) {
    if (!ab.first || !ab.second) {
      return Bad(file, absl::StrCat(module, " has lora_", ab.first ? "A" : "B", " without lora_",
                                    ab.first ? "B" : "A"));
    }
    a.modules[module] = {*ab.first, *ab.second};
  }
  if (a.modules.empty()) return Bad(file, "no LoRA weights");
  return a;
}

absl::StatusOr<std::shared_ptr<const LoraWeights>> Model::MakeLora(const LoraAdapter&) const {
  return absl::UnimplementedError("LoRA adapters are not served for encoder-decoder models");
}

absl::StatusOr<std::shared_ptr<const LoraWeights>> MakeLoraWeights(const LoraAdapter& adapter,
                                                                   const DecoderSpec& spec,
                                                                   const ShardLayout& layout,
                                                                   DType dtype,
                                                                   kernels::Device device) {
  const LoraTargets& t = spec.lora_targets;
  if (t.layers.empty()) {
    return absl::UnimplementedError(
        absl::StrCat(adapter.name, ": LoRA adapters are not served for this model's family"));
  }
  const int64_t d = spec.head_dim, r = adapter.rank;
  auto out = std::make_shared<LoraWeights>();
  out->scale = adapter.scale;
  out->layers.resize(spec.num_layers);
  std::set<std::string> used;
  auto find = [&](int64_t layer, const std::string& module) -> const std::pair<Tensor, Tensor>* {
    auto it = adapter.modules.find(absl::StrCat(t.layers, ".", layer, ".", module));
    if (it == adapter.modules.end()) return nullptr;
    used.insert(it->first);
    return &it->second;
  };
  auto shape_error = [&](int64_t layer, const std::string& module, const char* which,
                         const Tensor& got, int64_t rows, int64_t cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        adapter.name, ": ", t.layers, ".", layer, ".", module, ".lora_", which, " is [", got.dim(0),
        ", ", got.dim(1), "], the model's is [", rows, ", ", cols, "]"));
  };
  auto finish = [&](Tensor a, Tensor b, LoraPair* p) {
    p->a = a.To(dtype);
    p->b = b.To(dtype);
    if (device != kernels::Device::kCpu) {
      p->a = p->a.ToDevice(device);
      p->b = p->b.ToDevice(device);
    }
  };
  // A column-parallel fused linear: A's stacked, B's block-diagonal (this rank's rows).
  auto column_parallel = [&](int64_t layer, const std::vector<Part>& parts, int64_t in,
                             int64_t out_rows, LoraPair* p) -> absl::Status {
    std::vector<std::pair<const Part*, const std::pair<Tensor, Tensor>*>> present;
    for (const Part& part : parts) {
      if (const auto* ab = find(layer, part.module)) present.emplace_back(&part, ab);
    }
    if (present.empty()) return absl::OkStatus();
    const int64_t n = static_cast<int64_t>(present.size());
    Tensor a = Tensor::Empty({n * r, in}, DType::kF32);
    Tensor b = Tensor::Zeros({out_rows, n * r}, DType::kF32);
    for (int64_t j = 0; j < n; ++j) {
      const auto& [part, ab] = present[j];
      const Tensor& pa = ab->first;
      const Tensor& pb = ab->second;
      if (pa.dim(1) != in) return shape_error(layer, part->module, "A", pa, r, in);
      if (pb.dim(0) != part->whole)
        return shape_error(layer, part->module, "B", pb, part->whole, r);
      std::memcpy(a.data<float>() + j * r * in, pa.data<float>(), sizeof(float) * r * in);
      for (int64_t row = 0; row < part->rows.size(); ++row) {
        std::memcpy(b.data<float>() + (part->at + row) * n * r + j * r,
                    pb.data<float>() + (part->rows.begin + row) * r, sizeof(float) * r);
      }
    }
    finish(a, b, p);
    return absl::OkStatus();
  };
  // A row-parallel linear: this rank's input columns of A, B whole.
  auto row_parallel = [&](int64_t layer, const std::string& module, Range cols, int64_t in_whole,
                          int64_t out_rows, LoraPair* p) -> absl::Status {
    if (module.empty()) return absl::OkStatus();
    const auto* ab = find(layer, module);
    if (ab == nullptr) return absl::OkStatus();
    if (ab->first.dim(1) != in_whole)
      return shape_error(layer, module, "A", ab->first, r, in_whole);
    if (ab->second.dim(0) != out_rows) {
      return shape_error(layer, module, "B", ab->second, out_rows, r);
    }
    finish(Columns(ab->first, cols), ab->second, p);
    return absl::OkStatus();
  };

  const Range q = layout.q_rows(d), kv = layout.kv_rows(d), mlp = layout.intermediate;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    LoraLayer& out_layer = out->layers[l];
    // A fused module's parts share its A (stacked once per part: the same products, a few more
    // of them) and take their own rows of its B.
    std::vector<Part> qkv;
    const int64_t q_whole = spec.num_heads * d, kv_whole = spec.num_kv_heads * d;
    if (t.qkv.size() == 3) {
      qkv = {{t.qkv[0], q, 0, q_whole},
             {t.qkv[1], kv, q.size(), kv_whole},
             {t.qkv[2], kv, q.size() + kv.size(), kv_whole}};
    } else if (t.qkv.size() == 1) {
      const int64_t whole = q_whole + 2 * kv_whole;
      qkv = {{t.qkv[0], q, 0, whole},
             {t.qkv[0], kv.Shifted(q_whole), q.size(), whole},
             {t.qkv[0], kv.Shifted(q_whole + kv_whole), q.size() + kv.size(), whole}};
    }
    if (auto st = column_parallel(l, qkv, spec.hidden, q.size() + 2 * kv.size(), &out_layer.qkv);
        !st.ok()) {
      return st;
    }
    if (auto st = row_parallel(l, t.o, q, spec.num_heads * d, spec.hidden, &out_layer.o);
        !st.ok()) {
      return st;
    }
    std::vector<Part> up;
    const bool fused_gate_up = spec.mlp == MlpKind::kGated && t.up.size() == 1;
    for (size_t j = 0; j < (fused_gate_up ? 2 : t.up.size()); ++j) {
      const int64_t k = static_cast<int64_t>(j);
      up.push_back(fused_gate_up ? Part{t.up[0], mlp.Shifted(k * spec.intermediate), k * mlp.size(),
                                        2 * spec.intermediate}
                                 : Part{t.up[j], mlp, k * mlp.size(), spec.intermediate});
    }
    if (auto st = column_parallel(l, up, spec.hidden, static_cast<int64_t>(up.size()) * mlp.size(),
                                  &out_layer.up);
        !st.ok()) {
      return st;
    }
    if (auto st = row_parallel(l, t.down, mlp, spec.intermediate, spec.hidden, &out_layer.down);
        !st.ok()) {
      return st;
    }
  }
  std::vector<std::string> unused;
  for (const auto& [module, ab] : adapter.modules) {
    if (used.count(module) == 0) unused.push_back(module);
  }
  if (!unused.empty()) {
    std::vector<std::string> served = t.qkv;
    if (!t.o.empty()) served.push_back(t.o);
    served.insert(served.end(), t.up.begin(), t.up.end());
    if (!t.down.empty()) served.push_back(t.down);
    return absl::InvalidArgumentError(absl::StrCat(
        adapter.name, ": modules this model does not adapt: ", absl::StrJoin(unused, ", "),
        " (LoRA is served on ", t.layers, ".<layer>.{", absl::StrJoin(served, ","), "})"));
  }
  return std::shared_ptr<const LoraWeights>(std::move(out));
}

}  // namespace tgis::server

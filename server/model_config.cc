#include "server/model_config.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace tgis::server {

namespace fs = std::filesystem;
using Json = nlohmann::json;

absl::StatusOr<Json> ReadJsonObject(const fs::path& p, bool required) {
  std::error_code ec;
  if (!fs::exists(p, ec)) {
    if (required) return absl::NotFoundError(absl::StrCat(p.string(), ": not found"));
    return Json();
  }
  std::ifstream in(p);
  std::stringstream buf;
  buf << in.rdbuf();
  try {
    Json j = Json::parse(buf.str());
    if (!j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(p.string(), ": expected a JSON object"));
    }
    return j;
  } catch (const Json::exception& e) {  // parse_error, or out_of_range for a number like 1e500
    return absl::InvalidArgumentError(absl::StrCat(p.string(), ": invalid JSON: ", e.what()));
  }
}

namespace {

// eos_token_id may be a number or a list of numbers.
absl::StatusOr<std::vector<int32_t>> EosIds(const Json& j, const std::string& file) {
  std::vector<int32_t> out;
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return out;
  auto id = [&](const Json& v) -> absl::StatusOr<int32_t> {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": eos_token_id: ", v.dump(), " is not a token id"));
    }
    return v.get<int32_t>();
  };
  if (it->is_number_integer()) {
    auto v = id(*it);
    if (!v.ok()) return v.status();
    out.push_back(*v);
  } else if (it->is_array()) {
    for (const Json& e : *it) {
      auto v = id(e);
      if (!v.ok()) return v.status();
      out.push_back(*v);
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": eos_token_id: expected an integer or a list"));
  }
  return out;
}

// An optional token id (bos, pad): null or absent is none; a negative one is none too
// (some configs write -1); anything else must be a 32-bit id.
absl::StatusOr<std::optional<int32_t>> OptionalId(const Json& j, const char* key,
                                                  const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<int32_t>();
  if (!it->is_number_integer() || it->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", key, ": ", it->dump(), " is not a token id"));
  }
  if (it->get<int64_t>() < 0) return std::optional<int32_t>();
  return std::optional<int32_t>(it->get<int32_t>());
}

}  // namespace

template <typename T>
absl::StatusOr<T> ModelConfig::Get(const char* key, std::optional<T> default_value) const {
  auto it = raw.find(key);
  if (it == raw.end() || it->is_null()) {
    if (default_value) return *default_value;
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": missing field"));
  }
  if constexpr (std::is_same_v<T, int64_t>) {
    // An integer key: a float is refused (as torch refuses a float size), never truncated or
    // converted out of range; so is an unsigned beyond int64.
    if (!it->is_number_integer() ||
        (it->is_number_unsigned() &&
         it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", key, " = ", it->dump(), ": expected an integer"));
    }
  }
  try {
    return it->get<T>();
  } catch (const Json::exception&) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", key, " = ", it->dump(), ": wrong type"));
  }
}
template absl::StatusOr<int64_t> ModelConfig::Get(const char*, std::optional<int64_t>) const;
template absl::StatusOr<double> ModelConfig::Get(const char*, std::optional<double>) const;
template absl::StatusOr<bool> ModelConfig::Get(const char*, std::optional<bool>) const;
template absl::StatusOr<std::string> ModelConfig::Get(const char*,
                                                      std::optional<std::string>) const;

namespace {

// config.json of `source`'s kind read as its language model's config.
absl::StatusOr<nlohmann::json> LanguageModelConfig(const nlohmann::json& top,
                                                   const LanguageModelSource& source,
                                                   const std::string& config_file) {
  auto text = top.find("text_config");
  if (text == top.end() || !text->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_file, ": text_config: expected the language model's config (an object)"));
  }
  nlohmann::json merged = source.text_defaults;
  for (const std::string& key : source.inherited) {
    if (top.contains(key)) merged[key] = top[key];
  }
  for (auto it = text->begin(); it != text->end(); ++it) merged[it.key()] = it.value();
  const auto type = merged.find("model_type");
  if (type == merged.end() || !type->is_string() || *type != source.text_type) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_file, ": text_config.model_type = ", merged["model_type"].dump(), ": expected \"",
        source.text_type, "\" in a ", source.wrapper_type, " checkpoint"));
  }
  return merged;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::Load(const std::string& model_dir,
                                              const std::vector<LanguageModelSource>& sources) {
  const fs::path dir(model_dir);
  const std::string config_file = (dir / "config.json").string();
  auto raw = ReadJsonObject(dir / "config.json", /*required=*/true);
  if (!raw.ok()) return raw.status();
  auto gen = ReadJsonObject(dir / "generation_config.json", /*required=*/false);
  if (!gen.ok()) return gen.status();
  ModelConfig c;
  c.raw = std::move(*raw);
  auto type = c.Get<std::string>("model_type");
  if (!type.ok())
    return absl::InvalidArgumentError(absl::StrCat(config_file, ": model_type: missing"));
  c.model_type = *type;
  for (const LanguageModelSource& s : sources) {
    if (s.wrapper_type != c.model_type) continue;
    auto text = LanguageModelConfig(c.raw, s, config_file);
    if (!text.ok()) return text.status();
    c.raw = *std::move(text);
    c.model_type = s.text_type;
    c.source = s;
    LOG(INFO) << config_file << ": a " << s.wrapper_type
              << " checkpoint: serving its language model (" << s.text_type
              << ") alone, text in and text out";
    break;
  }
  // The names differ between architectures; builders fill in what they know better.
  auto first_int = [&c](std::initializer_list<const char*> keys) -> int64_t {
    for (const char* k : keys) {
      auto it = c.raw.find(k);
      if (it != c.raw.end() && it->is_number_integer()) return it->get<int64_t>();
    }
    return 0;
  };
  const std::initializer_list<const char*> vocab_keys = {"vocab_size"};
  const std::initializer_list<const char*> hidden_keys = {"hidden_size", "n_embd", "d_model",
                                                          "n_embed"};
  const std::initializer_list<const char*> layer_keys = {"num_hidden_layers", "n_layer",
                                                         "num_layers", "n_layers"};
  const std::initializer_list<const char*> head_keys = {"num_attention_heads", "n_head",
                                                        "num_heads", "n_heads"};
  c.vocab_size = first_int(vocab_keys);
  c.hidden_size = first_int(hidden_keys);
  c.num_layers = first_int(layer_keys);
  c.num_heads = first_int(head_keys);
  for (auto [value, keys, what] :
       {std::tuple{c.vocab_size, vocab_keys, "the vocabulary size"},
        std::tuple{c.hidden_size, hidden_keys, "the hidden size"},
        std::tuple{c.num_layers, layer_keys, "the layer count"},
        std::tuple{c.num_heads, head_keys, "the attention head count"}}) {
    if (value > 0) continue;
    std::string names, found = "none of them";
    for (const char* k : keys) {
      absl::StrAppend(&names, names.empty() ? "" : ", ", k);
      if (found == "none of them" && c.raw.contains(k)) {
        found = absl::StrCat(k, " = ", c.raw[k].dump());
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(config_file, ": model_type '", c.model_type,
                                                   "': ", what, " must be a positive integer (",
                                                   names, "; found ", found, ")"));
  }
  c.num_kv_heads = first_int({"num_key_value_heads"});
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  c.head_dim = first_int({"head_dim"});
  if (c.head_dim == 0 && c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  c.max_position_embeddings =
      first_int({"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"});
  auto tie = c.Get<bool>("tie_word_embeddings", false);
  if (!tie.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_file, ": tie_word_embeddings = ", c.raw["tie_word_embeddings"].dump(),
                     " is not a boolean"));
  }
  c.tie_word_embeddings = *tie;
  for (auto [dst, key] :
       {std::pair{&c.bos_token_id, "bos_token_id"}, std::pair{&c.pad_token_id, "pad_token_id"}}) {
    auto v = OptionalId(c.raw, key, config_file);
    if (!v.ok()) return v.status();
    *dst = *v;
  }
  auto eos = EosIds(c.raw, config_file);
  if (!eos.ok()) return eos.status();
  c.eos_token_ids = *eos;
  if (gen->is_object()) {
    auto geos = EosIds(*gen, (dir / "generation_config.json").string());
    if (!geos.ok()) return geos.status();
    if (!geos->empty()) c.eos_token_ids = *geos;
    const std::string gen_file = (dir / "generation_config.json").string();
    for (auto [dst, key] :
         {std::pair{&c.bos_token_id, "bos_token_id"}, std::pair{&c.pad_token_id, "pad_token_id"}}) {
      auto v = OptionalId(*gen, key, gen_file);
      if (!v.ok()) return v.status();
      if (v->has_value()) *dst = *v;
    }
  }
  return c;
}

}  // namespace tgis::server

// What the engine needs from a Hugging Face model folder's config.json and
// generation_config.json. Architecture-specific fields stay in `raw` for the model builders.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::server {

// A JSON file that must hold an object; a missing one is an error when `required`, else an
// empty Json. Errors name the file (and the parse position).
absl::StatusOr<nlohmann::json> ReadJsonObject(const std::filesystem::path& p, bool required);

// A multimodal checkpoint whose language model is served alone (text in, text out), as a
// family file registers it (ModelRegistry::RegisterLanguageModelSource).
struct LanguageModelSource {
  std::string wrapper_type;  // config.json's model_type (gemma3)
  std::string text_type;     // its text_config's model_type (gemma3_text)
  // The text config class's defaults: transformers saves in text_config only the keys that
  // differ from them. Keys it derives from others (Gemma 3's layer_types) stay out.
  nlohmann::json text_defaults;
  // Top-level keys that the language model takes when text_config has none (token ids,
  // quantization_config: what applies to the whole checkpoint).
  std::vector<std::string> inherited;
  // Where the language model's tensors are, under each transformers release's names.
  std::vector<std::pair<std::string, std::string>> tensor_prefixes;
  // The other towers' tensors (globs), deliberately not read: the reason is the caller's.
  std::vector<std::string> ignored;
};

struct ModelConfig {
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  std::vector<int32_t> eos_token_ids;
  std::optional<int32_t> bos_token_id;
  std::optional<int32_t> pad_token_id;
  bool tie_word_embeddings = false;
  nlohmann::json raw;  // config.json as is (a LanguageModelSource's: its text config)
  // Set when config.json's model_type is one of the `sources` Load was given.
  std::optional<LanguageModelSource> source;

  // Reads config.json (required) and generation_config.json (optional; its eos ids win). A
  // checkpoint of one of `sources` reads as its language model: text_config over the source's
  // defaults, the inherited top-level keys, text_config's model_type.
  static absl::StatusOr<ModelConfig> Load(const std::string& model_dir,
                                          const std::vector<LanguageModelSource>& sources = {});

  // Typed access to raw fields with a default, or an error naming config.json and the key.
  template <typename T>
  absl::StatusOr<T> Get(const char* key, std::optional<T> default_value = std::nullopt) const;
};

}  // namespace tgis::server

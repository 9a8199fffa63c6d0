// What the engine needs from a Hugging Face model folder's config.json and
// generation_config.json. Architecture-specific fields stay in `raw` for the model builders.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::server {

// A JSON file that must hold an object; a missing one is an error when `required`, else an
// empty Json. Errors name the file (and the parse position).
absl::StatusOr<nlohmann::json> ReadJsonObject(const std::filesystem::path& p, bool required);

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
  nlohmann::json raw;  // config.json as is

  // Reads config.json (required) and generation_config.json (optional; its eos ids win).
  static absl::StatusOr<ModelConfig> Load(const std::string& model_dir);

  // Typed access to raw fields with a default, or an error naming config.json and the key.
  template <typename T>
  absl::StatusOr<T> Get(const char* key, std::optional<T> default_value = std::nullopt) const;
};

}  // namespace tgis::server

// GPTQModel's `dynamic` quantization config key: per-module exceptions to a GPTQ (or
// GPTQModel-written AWQ) checkpoint's bits and group size. Its keys are Python regular
// expressions over module names ("model.layers.3.mlp.down_proj"), optionally prefixed "+:"
// (override) or "-:" (the module stays unquantized); its values are the overridden config keys.
// As GPTQModel and vLLM read it, the first rule in the file's order whose pattern matches the
// name from its start (Python's re.match) decides.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::server {

struct DynamicRule {
  std::string key;  // as the config writes it, for errors
  std::shared_ptr<const std::regex> pattern;
  bool excluded = false;  // "-:": the module is not quantized
  // The pattern may match anywhere in the name (Python's re.search: AutoRound's extra_config),
  // not only from its start (re.match: GPTQModel's dynamic).
  bool search = false;
  std::optional<int> bits;
  std::optional<int64_t> group_size;
};

// What a rule's overrides may hold besides bits and group_size.
struct DynamicRuleKeys {
  std::set<int> bits;                // the values bits may take
  std::set<std::string> tensor_led;  // keys the tensors already tell (sym, desc_act)
  std::set<std::string> ignored;     // keys that only steered the quantizer
};

// The `dynamic` object of the JSON object at `object_key` ("" for the root) of `file`, in the
// file's order (a JSON reader that sorts keys would change which rule wins). Empty when it
// is missing, null or {}. Errors name `where`, the rule and what is wrong.
absl::StatusOr<std::vector<DynamicRule>> ReadDynamicRules(const std::filesystem::path& file,
                                                          const std::string& object_key,
                                                          const std::string& where,
                                                          const DynamicRuleKeys& keys);

// The value of `key` in the JSON object at `object_key` ("" for the root) of `file`, with its
// objects' keys in the file's order (the rules' order decides); null where either is missing.
absl::StatusOr<nlohmann::ordered_json> ReadInFileOrder(const std::filesystem::path& file,
                                                       const std::string& object_key,
                                                       const std::string& key);

// The rule that decides for the module `name`, or nullptr where none matches.
const DynamicRule* MatchDynamicRule(const std::vector<DynamicRule>& rules, const std::string& name);

}  // namespace tgis::server

// Intel AutoRound's checkpoints (quant_method "auto-round", before 2025 "intel/auto-round"):
// integer codes packed as AutoGPTQ (v1 zeros), GPTQModel (v2 zeros) or AutoAWQ GEMM write
// them, chosen by `packing_format` (formerly `backend`), with per-layer exceptions in
// `extra_config`. AutoRound's own exports under quant_method "gptq" carry its calibration keys
// too: GPTQ configs accept them through AutoRoundKeys.
#pragma once

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/quantization.h"

namespace tgis::server {

// An auto-round quantization_config: the GPTQ or AWQ reading its packing stands for.
absl::StatusOr<QuantConfig> ParseAutoRound(const nlohmann::json& j, const std::string& where);

// Checks the keys AutoRound writes besides a GPTQ or AWQ config's own (its data type, the
// activation and calibration settings), refusing those that change what the tensors mean.
absl::Status CheckAutoRoundKeys(const nlohmann::json& j, const std::string& where);
// Those keys (read by CheckAutoRoundKeys, or calibration only).
const std::set<std::string>& AutoRoundKeys();

// `extra_config` of the config at `object_key` of `file` as rules (MatchDynamicRule): a layer
// named exactly by a key takes that key's overrides; else the first key, in the file's order,
// that matches anywhere in the name as a regular expression (Python's re.search), as
// AutoRound's and vLLM's readers apply them. bits 16 leaves the layer unquantized.
absl::StatusOr<std::vector<DynamicRule>> ReadAutoRoundRules(const std::filesystem::path& file,
                                                            const std::string& object_key,
                                                            const std::string& where,
                                                            const QuantConfig& q);

}  // namespace tgis::server

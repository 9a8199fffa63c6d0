// Internal to quantization.cc: llm-compressor's compressed-tensors quantization config
// (config.json's quantization_config with quant_method "compressed-tensors").
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/model_config.h"
#include "server/quantization.h"

namespace tgis::server {

// float8 weights (kFp8: "float-quantized", "naive-quantized") or integer ones (kCompressedInt:
// "pack-quantized", "int-quantized", "naive-quantized"), per tensor, output row or group;
// one kind per checkpoint. Every key is read or on a commented list of ignored ones.
absl::StatusOr<QuantConfig> ParseCompressedTensors(const nlohmann::json& j,
                                                   const std::string& where);

}  // namespace tgis::server

// Reads a config's rotary settings (rope_theta, rope_scaling, partial rotary) into a DecoderSpec
// as transformers reads them, for every rope type it knows.
#pragma once

#include "absl/status/status.h"
#include "server/decoder_model.h"
#include "server/model_config.h"

namespace tgis::server {

// Sets spec->rotary (the frequencies of sequences within the original context),
// spec->rope_by_length (dynamic NTK, LongRoPE), spec->max_positions (the original context
// times the scaling factor for linear, dynamic and YaRN, as vLLM serves them) and folds
// YaRN's / LongRoPE's attention factor into spec->attn_scale. spec->head_dim must be set.
// `theta` is the config's base (its key differs between architectures). An unknown rope type or
// a bad value fails, naming config.json's key and the value.
absl::Status ReadRope(const ModelConfig& config, int rotary_dim, double theta, DecoderSpec* spec);

}  // namespace tgis::server

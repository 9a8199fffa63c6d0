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
// YaRN's / LongRoPE's attention factor into spec->attn_scale (on top of a scale already set
// there, else of 1/sqrt(head_dim)). spec->head_dim must be set.
// `theta` is the config's base (its key differs between architectures). An unknown rope type or
// a bad value fails, naming config.json's key and the value.
absl::Status ReadRope(const ModelConfig& config, int rotary_dim, double theta, DecoderSpec* spec);

// The rotary dimensions of a head rotated in part: transformers' int(head_dim * fraction),
// which our rotary kernels need even and non-zero. `key` (config.json's: rotary_pct,
// partial_rotary_factor) for the error.
absl::StatusOr<int> PartialRotaryDim(int64_t head_dim, double fraction, const char* key);

}  // namespace tgis::server

// Request validation as TGIS does it: the same defaults, the same checks in the same order and
// the same INVALID_ARGUMENT messages, word for word (clients match on them).
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/generation.pb.h"
#include "router/generation_params.h"

namespace tgis::router {

inline constexpr size_t kMaxStopSequences = 6;
inline constexpr size_t kMaxStopSequenceBytes = 240;
// max_new_tokens when a request leaves it at 0.
inline constexpr uint32_t kDefaultMaxNewTokens = 20;

struct ValidationLimits {
  uint32_t max_sequence_length = 2048;  // input + generated tokens
  uint32_t max_new_tokens = 1024;
  bool default_include_stop_seqs = true;
};

// Converts the request-wide parameters (null: all defaults) and checks everything that does not
// depend on the input. A time limit counts from `now`.
absl::StatusOr<GenerationParams> ConvertParameters(const fmaas::Parameters* params,
                                                   const ValidationLimits& limits,
                                                   Clock::time_point now);

// Checks one input of `input_tokens` tokens (after truncation) and finishes its parameters:
// a sampling request without a seed gets `random_seed`, and max_new_tokens is lowered (and
// flagged as a token limit) where input + max_new_tokens would exceed max_sequence_length.
// `prefix_length`: the virtual tokens of the request's prompt-tuning prefix (0: none).
absl::Status ValidateInput(uint32_t input_tokens, uint32_t prefix_length,
                           const ValidationLimits& limits, uint32_t random_seed,
                           GenerationParams* params);

// The error for an input known to have at least `input_tokens_at_least` tokens (a prefix of
// it had that many; see TokensOfLongPrefix) that cannot fit: TGIS's message with "at least"
// before the count, since the exact count was never computed.
absl::Status InputTooLong(size_t input_tokens_at_least, uint32_t prefix_length,
                          const ValidationLimits& limits);

// TGIS's validation error for a prefix the shards could not load, from their status: the
// message as TGIS's router words a shard client error.
absl::Status PromptPrefixError(std::string_view prefix_id, const absl::Status& shard_status);

}  // namespace tgis::router

// A generation request's parameters once TGIS's defaults are applied and they are validated:
// what the batcher and the shard work from (the public fmaas.Parameters are converted once,
// in validation.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace tgis::router {

using Clock = std::chrono::steady_clock;

// What goes back to the client besides the text (fmaas.ResponseOptions).
struct ResponseOptions {
  bool input_text = false;
  bool generated_tokens = false;
  bool input_tokens = false;
  bool token_logprobs = false;
  bool token_ranks = false;
  uint32_t top_n_tokens = 0;
};

struct LengthPenalty {
  uint32_t start_index = 0;
  float decay_factor = 1.0f;
};

struct GenerationParams {
  // Greedy unless `sample`; the sampling fields mean nothing for greedy requests.
  bool sample = false;
  float temperature = 1.0f;
  int32_t top_k = 0;  // 0: off (validated non-negative)
  float top_p = 1.0f;
  float typical_p = 1.0f;
  // Always set for sampling requests once an input is validated (chosen at random if the
  // client gave none, and returned in the response).
  std::optional<uint64_t> seed;

  float repetition_penalty = 1.0f;
  std::optional<LengthPenalty> length_penalty;

  uint32_t max_new_tokens = 20;
  uint32_t min_new_tokens = 0;
  // max_new_tokens was lowered to fit max_sequence_length: reaching it is TOKEN_LIMIT.
  bool max_is_token_limit = false;
  std::vector<std::string> stop_sequences;
  bool include_stop_sequence = true;
  std::optional<Clock::time_point> deadline;  // from time_limit_millis

  uint32_t truncate_input_tokens = 0;  // 0: no truncation
  ResponseOptions response;
  // Guided decoding (DecodingParameters' regex or choice), compiled once for every input of
  // the call; null: unconstrained.
  std::shared_ptr<const grammar::ByteDfa> guided;
};

}  // namespace tgis::router

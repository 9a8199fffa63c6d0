// The stopping criteria evaluated after every generated token, in TGIS's order of precedence.
#pragma once

#include <cstdint>

#include "proto/generation.pb.h"
#include "router/generation_params.h"

namespace tgis::router {

struct TokenFacts {
  uint32_t generated = 0;  // tokens generated so far, this one included
  bool is_eos = false;     // the token is one of the model's EOS ids
  bool past_deadline = false;
};

// NOT_FINISHED, TIME_LIMIT, EOS_TOKEN, MAX_TOKENS or TOKEN_LIMIT. The time limit comes first,
// even before min_new_tokens; nothing else stops a request before min_new_tokens; EOS wins over
// the token limits. Stop sequences rank last: they may end a request only where this returns
// NOT_FINISHED and MayStopOnSequence() holds.
fmaas::StopReason CheckStop(const GenerationParams& params, const TokenFacts& facts);

inline bool MayStopOnSequence(const GenerationParams& params, const TokenFacts& facts) {
  return facts.generated >= params.min_new_tokens;
}

}  // namespace tgis::router

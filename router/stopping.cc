#include "router/stopping.h"

namespace tgis::router {

fmaas::StopReason CheckStop(const GenerationParams& params, const TokenFacts& facts) {
  if (facts.past_deadline) return fmaas::TIME_LIMIT;
  if (facts.generated < params.min_new_tokens) return fmaas::NOT_FINISHED;
  if (facts.is_eos) return fmaas::EOS_TOKEN;
  if (facts.generated >= params.max_new_tokens) {
    return params.max_is_token_limit ? fmaas::TOKEN_LIMIT : fmaas::MAX_TOKENS;
  }
  return fmaas::NOT_FINISHED;
}

}  // namespace tgis::router

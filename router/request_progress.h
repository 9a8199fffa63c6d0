// One request's progress through generation: its tokens become text (incremental
// detokenization), stop sequences and the other stopping criteria are evaluated on them, and
// the result is shaped into TGIS's messages. A streamed request's messages and a unary
// request's response are built from the same pieces, so their text, tokens, counts and stop
// reason always agree.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/generate.pb.h"
#include "proto/generation.pb.h"
#include "router/request.h"
#include "router/stop_sequences.h"
#include "tokenizer/tokenizer.h"

namespace tgis::router {

// How generated ids become text, the same for every request.
struct DetokenizationConfig {
  bool skip_special_tokens = true;  // false with OUTPUT_SPECIAL_TOKENS
  std::vector<int32_t> eos_token_ids;
  // A token that generated tokens are decoded after, so that the first one decodes as a
  // continuation (keeps its leading space), as TGIS does.
  std::optional<int32_t> placeholder_id;
  // Encoder-decoder models: the output is decoded whole (no placeholder), and a unary
  // response that echoes the input separates it from the output with "\n\n" (TGIS).
  bool seq2seq = false;
};

// Picks the placeholder token of a tokenizer ("A", as TGIS).
std::optional<int32_t> ContinuationPlaceholder(const Tokenizer& tokenizer);

// The first message of a stream: input token count, seed, and the input text when asked.
fmaas::GenerationResponse StreamHeader(const GenerationRequest& request);

// The response for a request whose time limit passed before it was scheduled: TIME_LIMIT with
// no tokens (for a stream, its last message).
fmaas::GenerationResponse EarlyTimeoutResponse(const GenerationRequest& request);

class RequestProgress {
 public:
  // `tokenizer` and `config` must outlive this; `request` is read here only.
  RequestProgress(const Tokenizer& tokenizer, const DetokenizationConfig& config,
                  const GenerationRequest& request);

  // Records the prompt's token details from the prefill (the shard may send fewer or none:
  // those tokens get only their text). For a stream, returns the message that carries them.
  std::optional<fmaas::GenerationResponse> AddInputTokens(
      const google::protobuf::RepeatedPtrField<generate::v1::TokenDetail>& details);

  struct Step {
    fmaas::StopReason reason = fmaas::NOT_FINISHED;
    // For a stream: the message to send now (none when it would carry nothing).
    std::optional<fmaas::GenerationResponse> message;
  };
  // Takes the next generated token. An error (detokenization) ends the request.
  absl::StatusOr<Step> AddToken(const generate::v1::TokenDetail& token, Clock::time_point now);

  // The unary response, once AddToken has returned a stop reason.
  fmaas::GenerationResponse TakeUnaryResponse();

  uint32_t generated() const { return generated_; }

 private:
  fmaas::TokenInfo ToTokenInfo(const generate::v1::TokenDetail& detail) const;
  bool IsEos(int32_t id) const;

  const Tokenizer& tokenizer_;
  const DetokenizationConfig& config_;
  const GenerationParams& params_;
  const GenerationRequest& request_;
  IncrementalDecoder decoder_;
  StopSequenceMatcher matcher_;
  uint32_t generated_ = 0;
  // Unary requests accumulate their response here.
  fmaas::GenerationResponse unary_;
};

}  // namespace tgis::router

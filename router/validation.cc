#include "router/validation.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/lru_cache.h"

namespace tgis::router {
namespace {

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

absl::Status StopSequencesError() {
  return Invalid(absl::StrCat("can specify at most ", kMaxStopSequences,
                              " non-empty stop sequences, each not more than ",
                              kMaxStopSequenceBytes, " UTF8 bytes"));
}

// Applies TGIS's conversion of the public parameters (its grpc_server.rs convert_params),
// quirks included, so that a request means the same thing here as there.
GenerationParams Convert(const fmaas::Parameters& p, bool default_include_stop_seqs,
                         Clock::time_point now) {
  GenerationParams gp;
  gp.include_stop_sequence = default_include_stop_seqs;
  gp.truncate_input_tokens = p.truncate_input_tokens();

  if (p.has_response()) {
    const fmaas::ResponseOptions& r = p.response();
    gp.response.input_text = r.input_text();
    gp.response.generated_tokens = r.generated_tokens();
    gp.response.input_tokens = r.input_tokens();
    gp.response.token_logprobs = r.token_logprobs();
    gp.response.token_ranks = r.token_ranks();
    gp.response.top_n_tokens = r.top_n_tokens();
  }

  if (p.has_decoding()) {
    if (p.decoding().repetition_penalty() != 0.0f) {
      gp.repetition_penalty = p.decoding().repetition_penalty();
    }
    if (p.decoding().has_length_penalty()) {
      gp.length_penalty = LengthPenalty{p.decoding().length_penalty().start_index(),
                                        p.decoding().length_penalty().decay_factor()};
    }
  }

  if (p.has_stopping()) {
    const fmaas::StoppingCriteria& s = p.stopping();
    if (s.max_new_tokens() != 0) gp.max_new_tokens = s.max_new_tokens();
    gp.min_new_tokens = s.min_new_tokens();
    gp.stop_sequences.assign(s.stop_sequences().begin(), s.stop_sequences().end());
    if (s.has_include_stop_sequence()) gp.include_stop_sequence = s.include_stop_sequence();
    if (s.time_limit_millis() > 0) {
      gp.deadline = now + std::chrono::milliseconds(s.time_limit_millis());
    }
  }

  // Sampling parameters count only for SAMPLE; a greedy request's are ignored, as TGIS does
  // (its strict mode that rejects them is off).
  if (p.method() == fmaas::SAMPLE) {
    gp.sample = true;
    gp.temperature = 0.0f;
    if (p.has_sampling()) {
      const fmaas::SamplingParameters& s = p.sampling();
      gp.temperature = s.temperature();
      // TGIS reads the unsigned field as a signed 32-bit value: 2^31 and above are negative
      // and fail the top_k check below.
      gp.top_k = static_cast<int32_t>(s.top_k());
      if (s.top_p() != 0.0f) gp.top_p = s.top_p();
      if (s.typical_p() != 0.0f) gp.typical_p = s.typical_p();
      if (s.has_seed()) gp.seed = s.seed();
    }
    if (gp.temperature == 0.0f) gp.temperature = 1.0f;  // sampling at temperature 0: none
  }
  return gp;
}

// Clients send the same schema or pattern call after call: the automata of the last few are
// kept (a JSON schema's takes milliseconds to tens of milliseconds to compile).
class GuidedCache {
 public:
  using Compiled = absl::StatusOr<std::shared_ptr<const grammar::ByteDfa>>;
  template <typename CompileFn>
  Compiled Get(const std::string& key, CompileFn compile) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (Compiled* cached = cache_.Find(key)) return *cached;
    }
    // A refusal is kept too: a client retrying a pattern too complex to compile pays for it
    // once.
    absl::StatusOr<grammar::ByteDfa> dfa = compile();
    Compiled compiled = dfa.ok()
                            ? Compiled(std::make_shared<const grammar::ByteDfa>(*std::move(dfa)))
                            : Compiled(dfa.status());
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_.Find(key) == nullptr) cache_.Insert(key, compiled);
    return compiled;
  }

 private:
  std::mutex mu_;
  LruCache<Compiled> cache_{64};
};

// vllm-tgis-adapter's guided decoding (its get_structured_output_params): regex, choice,
// json_schema, format JSON and (regular) GBNF grammars.
absl::Status CompileGuided(const fmaas::DecodingParameters& d, GenerationParams* gp) {
  using D = fmaas::DecodingParameters;
  static GuidedCache* cache = new GuidedCache;
  GuidedCache::Compiled dfa;
  std::string what;
  switch (d.guided_case()) {
    case D::GUIDED_NOT_SET:
      return absl::OkStatus();
    case D::kFormat:
      if (d.format() == D::TEXT) return absl::OkStatus();
      what = "format JSON";
      dfa = cache->Get("format\n", [] { return grammar::CompileJsonObject(); });
      break;
    case D::kJsonSchema:
      what = "json_schema";
      dfa = cache->Get("schema\n" + d.json_schema(),
                       [&] { return grammar::CompileJsonSchema(d.json_schema()); });
      break;
    case D::kGrammar:
      what = "grammar";
      dfa =
          cache->Get("grammar\n" + d.grammar(), [&] { return grammar::CompileGbnf(d.grammar()); });
      break;
    case D::kRegex:
      what = "regex";
      dfa = cache->Get("regex\n" + d.regex(), [&] { return grammar::CompileRegex(d.regex()); });
      break;
    case D::kChoice: {
      if (d.choice().choices_size() < 2) return Invalid("Must provide at least two choices");
      what = "choice";
      std::vector<std::string> choices(d.choice().choices().begin(), d.choice().choices().end());
      dfa = cache->Get("choice\n" + absl::StrJoin(choices, absl::string_view("\0", 1)),
                       [&] { return grammar::CompileChoices(choices); });
      break;
    }
  }
  if (!dfa.ok()) {
    // json_schema's and grammar's messages name what they are about themselves.
    const std::string message =
        what == "json_schema" || what == "grammar"
            ? absl::StrCat("guided decoding: ", dfa.status().message())
            : absl::StrCat("guided decoding: ", what, ": ", dfa.status().message());
    return absl::Status(dfa.status().code(), message);
  }
  gp->guided = *std::move(dfa);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GenerationParams> ConvertParameters(const fmaas::Parameters* params,
                                                   const ValidationLimits& limits,
                                                   Clock::time_point now) {
  GenerationParams gp;
  if (params != nullptr) {
    gp = Convert(*params, limits.default_include_stop_seqs, now);
  } else {
    gp.include_stop_sequence = limits.default_include_stop_seqs;
  }

  // TGIS's checks, in its order. The comparisons are written so that NaN fails them too.
  if (gp.sample && !(gp.temperature >= 0.05f)) {
    return Invalid("temperature must be >= 0.05");
  }
  if (!(gp.top_p > 0.0f && gp.top_p <= 1.0f)) {
    return Invalid("top_p must be > 0.0 and <= 1.0");
  }
  if (!(gp.typical_p <= 1.0f)) {
    return Invalid("typical_p must be <= 1.0");
  }
  if (gp.top_k < 0) {
    return Invalid("top_k must be strictly positive");
  }
  if (gp.max_new_tokens > limits.max_new_tokens) {
    return Invalid(absl::StrCat("max_new_tokens must be <= ", limits.max_new_tokens));
  }
  if (gp.min_new_tokens > gp.max_new_tokens) {
    return Invalid("min_new_tokens must be <= max_new_tokens");
  }
  if (!(gp.repetition_penalty > 0.0f)) {
    return Invalid("repetition_penalty must be > 0.0");
  }
  if (gp.length_penalty.has_value() &&
      !(gp.length_penalty->decay_factor >= 1.0f && gp.length_penalty->decay_factor <= 10.0f)) {
    return Invalid("length_penalty must be >= 1.0 and <= 10.0");
  }
  if (gp.stop_sequences.size() > kMaxStopSequences) return StopSequencesError();
  const ResponseOptions& r = gp.response;
  if ((r.token_logprobs || r.token_ranks || r.top_n_tokens != 0) &&
      !(r.input_tokens || r.generated_tokens)) {
    return Invalid("must request input and/or generated tokens to request extra token detail");
  }
  for (const std::string& s : gp.stop_sequences) {
    if (s.empty() || s.size() > kMaxStopSequenceBytes) return StopSequencesError();
  }
  if (params != nullptr && params->has_decoding()) {
    absl::Status guided = CompileGuided(params->decoding(), &gp);
    if (!guided.ok()) return guided;
  }
  return gp;
}

absl::Status InputTooLong(size_t input_tokens_at_least, uint32_t prefix_length,
                          const ValidationLimits& limits) {
  return Invalid(absl::StrCat("input tokens (at least ", input_tokens_at_least,
                              ") plus prefix length (", prefix_length, ") must be < ",
                              limits.max_sequence_length));
}

absl::Status ValidateInput(uint32_t input_tokens, uint32_t prefix_length,
                           const ValidationLimits& limits, uint32_t random_seed,
                           GenerationParams* params) {
  const uint64_t effective = static_cast<uint64_t>(input_tokens) + prefix_length;
  if (effective >= limits.max_sequence_length) {
    return Invalid(absl::StrCat("input tokens (", input_tokens, ") plus prefix length (",
                                prefix_length, ") must be < ", limits.max_sequence_length));
  }
  if (effective + params->min_new_tokens > limits.max_sequence_length) {
    return Invalid(absl::StrCat("input tokens (", input_tokens, ") plus prefix length (",
                                prefix_length, ") plus min_new_tokens (", params->min_new_tokens,
                                ") must be <= ", limits.max_sequence_length));
  }
  if (params->sample && !params->seed.has_value()) {
    // 32 bits, as TGIS, so that the seed returned to the client stays short.
    params->seed = random_seed;
  }
  if (effective + params->max_new_tokens > limits.max_sequence_length) {
    params->max_new_tokens = static_cast<uint32_t>(limits.max_sequence_length - effective);
    params->max_is_token_limit = true;
  }
  return absl::OkStatus();
}

absl::Status PromptPrefixError(std::string_view prefix_id, const absl::Status& shard_status) {
  // TGIS's ClientError wording of the shard's status.
  std::string cause(shard_status.message());
  if (shard_status.code() == absl::StatusCode::kUnavailable) {
    cause = absl::StrCat("Could not connect to Text Generation server: ", cause);
  } else if (shard_status.code() == absl::StatusCode::kResourceExhausted) {
    cause = "GPU out of memory";
  }
  return Invalid(
      absl::StrCat("can't retrieve prompt prefix with id '", std::string(prefix_id), "': ", cause));
}

}  // namespace tgis::router

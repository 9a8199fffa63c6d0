// Validation: TGIS's defaults, checks, order and messages (router/validation.h).
#include <gtest/gtest.h>

#include <string>

#include "router/validation.h"

namespace tgis::router {
namespace {

const ValidationLimits kLimits{
    .max_sequence_length = 200, .max_new_tokens = 169, .default_include_stop_seqs = true};

absl::StatusOr<GenerationParams> Convert(const fmaas::Parameters& p) {
  return ConvertParameters(&p, kLimits, Clock::now());
}

std::string ErrorOf(const fmaas::Parameters& p) {
  absl::StatusOr<GenerationParams> r = Convert(p);
  if (r.ok()) return "OK";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(r.status().message());
}

fmaas::Parameters Sampling(float temperature) {
  fmaas::Parameters p;
  p.set_method(fmaas::SAMPLE);
  p.mutable_sampling()->set_temperature(temperature);
  return p;
}

TEST(RouterValidation, DefaultsWithoutParameters) {
  absl::StatusOr<GenerationParams> r = ConvertParameters(nullptr, kLimits, Clock::now());
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->sample);
  EXPECT_EQ(r->max_new_tokens, kDefaultMaxNewTokens);
  EXPECT_EQ(r->min_new_tokens, 0u);
  EXPECT_TRUE(r->include_stop_sequence);
  EXPECT_FALSE(r->deadline.has_value());
  EXPECT_EQ(r->repetition_penalty, 1.0f);

  ValidationLimits exclude = kLimits;
  exclude.default_include_stop_seqs = false;
  EXPECT_FALSE(ConvertParameters(nullptr, exclude, Clock::now())->include_stop_sequence);
}

TEST(RouterValidation, StoppingDefaultsAndOverrides) {
  fmaas::Parameters p;
  p.mutable_stopping()->set_max_new_tokens(0);  // 0 means the default
  EXPECT_EQ(Convert(p)->max_new_tokens, 20u);
  p.mutable_stopping()->set_max_new_tokens(7);
  p.mutable_stopping()->set_include_stop_sequence(false);
  p.mutable_stopping()->set_time_limit_millis(250);
  const Clock::time_point now = Clock::now();
  absl::StatusOr<GenerationParams> r = ConvertParameters(&p, kLimits, now);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->max_new_tokens, 7u);
  EXPECT_FALSE(r->include_stop_sequence);
  ASSERT_TRUE(r->deadline.has_value());
  EXPECT_EQ(*r->deadline, now + std::chrono::milliseconds(250));
}

TEST(RouterValidation, SamplingConversion) {
  fmaas::Parameters p = Sampling(0.0f);  // sampling at temperature 0 means 1.0
  absl::StatusOr<GenerationParams> r = Convert(p);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->sample);
  EXPECT_EQ(r->temperature, 1.0f);
  EXPECT_EQ(r->top_p, 1.0f);  // 0 means off
  EXPECT_FALSE(r->seed.has_value());

  p.mutable_sampling()->set_seed(99);
  p.mutable_sampling()->set_top_k(3);
  p.mutable_sampling()->set_top_p(0.7f);
  p.mutable_sampling()->set_typical_p(0.6f);
  r = Convert(p);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->seed, 99u);
  EXPECT_EQ(r->top_k, 3u);
  EXPECT_EQ(r->top_p, 0.7f);
  EXPECT_EQ(r->typical_p, 0.6f);

  // Without method SAMPLE the sampling parameters are ignored, even invalid ones.
  fmaas::Parameters greedy;
  greedy.mutable_sampling()->set_temperature(0.01f);
  greedy.mutable_sampling()->set_top_p(7.0f);
  r = Convert(greedy);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->sample);
}

TEST(RouterValidation, Messages) {
  EXPECT_EQ(ErrorOf(Sampling(0.02f)), "temperature must be >= 0.05");
  EXPECT_EQ(ErrorOf(Sampling(0.05f)), "OK");

  fmaas::Parameters p = Sampling(1.0f);
  p.mutable_sampling()->set_top_p(1.5f);
  EXPECT_EQ(ErrorOf(p), "top_p must be > 0.0 and <= 1.0");
  p.mutable_sampling()->set_top_p(-0.5f);
  EXPECT_EQ(ErrorOf(p), "top_p must be > 0.0 and <= 1.0");

  p = Sampling(1.0f);
  p.mutable_sampling()->set_typical_p(1.01f);
  EXPECT_EQ(ErrorOf(p), "typical_p must be <= 1.0");
  p.mutable_sampling()->set_typical_p(1.0f);
  EXPECT_EQ(ErrorOf(p), "OK");

  p = fmaas::Parameters();
  p.mutable_stopping()->set_max_new_tokens(170);
  EXPECT_EQ(ErrorOf(p), "max_new_tokens must be <= 169");
  p.mutable_stopping()->set_max_new_tokens(10);
  p.mutable_stopping()->set_min_new_tokens(20);
  EXPECT_EQ(ErrorOf(p), "min_new_tokens must be <= max_new_tokens");

  p = fmaas::Parameters();
  p.mutable_decoding()->set_repetition_penalty(-1.0f);
  EXPECT_EQ(ErrorOf(p), "repetition_penalty must be > 0.0");

  p = fmaas::Parameters();
  p.mutable_decoding()->set_repetition_penalty(1.2f);
  p.mutable_decoding()->mutable_length_penalty()->set_decay_factor(0.5f);
  EXPECT_EQ(ErrorOf(p), "length_penalty must be >= 1.0 and <= 10.0");
  p.mutable_decoding()->mutable_length_penalty()->set_decay_factor(10.5f);
  EXPECT_EQ(ErrorOf(p), "length_penalty must be >= 1.0 and <= 10.0");
  p.mutable_decoding()->mutable_length_penalty()->set_decay_factor(1.01f);
  p.mutable_decoding()->mutable_length_penalty()->set_start_index(8);
  absl::StatusOr<GenerationParams> r = Convert(p);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->length_penalty.has_value());
  EXPECT_EQ(r->length_penalty->start_index, 8u);

  const std::string stop_message =
      "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes";
  p = fmaas::Parameters();
  for (int i = 0; i < 7; ++i) p.mutable_stopping()->add_stop_sequences("s");
  EXPECT_EQ(ErrorOf(p), stop_message);
  p = fmaas::Parameters();
  p.mutable_stopping()->add_stop_sequences("fine");
  p.mutable_stopping()->add_stop_sequences("");
  EXPECT_EQ(ErrorOf(p), stop_message);
  p = fmaas::Parameters();
  p.mutable_stopping()->add_stop_sequences(std::string(241, 'x'));
  EXPECT_EQ(ErrorOf(p), stop_message);
  p.mutable_stopping()->set_stop_sequences(0, std::string(240, 'x'));
  EXPECT_EQ(ErrorOf(p), "OK");

  const std::string detail_message =
      "must request input and/or generated tokens to request extra token detail";
  for (int which = 0; which < 3; ++which) {
    p = fmaas::Parameters();
    if (which == 0) p.mutable_response()->set_token_logprobs(true);
    if (which == 1) p.mutable_response()->set_token_ranks(true);
    if (which == 2) p.mutable_response()->set_top_n_tokens(2);
    EXPECT_EQ(ErrorOf(p), detail_message);
    p.mutable_response()->set_input_tokens(true);
    EXPECT_EQ(ErrorOf(p), "OK");
  }
}

// TGIS's convert_params reads length_penalty whether or not repetition_penalty is set.
TEST(RouterValidation, LengthPenaltyAppliesOnItsOwn) {
  fmaas::Parameters p;
  p.mutable_decoding()->mutable_length_penalty()->set_decay_factor(0.5f);
  EXPECT_EQ(ErrorOf(p), "length_penalty must be >= 1.0 and <= 10.0");
  p.mutable_decoding()->mutable_length_penalty()->set_decay_factor(1.5f);
  p.mutable_decoding()->mutable_length_penalty()->set_start_index(3);
  absl::StatusOr<GenerationParams> r = Convert(p);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->length_penalty.has_value());
  EXPECT_EQ(r->length_penalty->start_index, 3u);
  EXPECT_FLOAT_EQ(r->length_penalty->decay_factor, 1.5f);
  EXPECT_FLOAT_EQ(r->repetition_penalty, 1.0f);
}

// TGIS reads the unsigned top_k as an i32: 2^31 and above are negative and refused.
TEST(RouterValidation, TopKIsSigned) {
  fmaas::Parameters p = Sampling(0.7f);
  p.mutable_sampling()->set_top_k(0x80000000u);
  EXPECT_EQ(ErrorOf(p), "top_k must be strictly positive");
  p.mutable_sampling()->set_top_k(0x7fffffffu);
  EXPECT_EQ(ErrorOf(p), "OK");
  // Greedy requests' sampling fields are not read at all.
  p.set_method(fmaas::GREEDY);
  p.mutable_sampling()->set_top_k(0xffffffffu);
  EXPECT_EQ(ErrorOf(p), "OK");
}

TEST(RouterValidation, CheckOrderFollowsTgis) {
  // Both wrong: the earlier check's message wins.
  fmaas::Parameters p = Sampling(0.01f);
  p.mutable_sampling()->set_top_p(2.0f);
  EXPECT_EQ(ErrorOf(p), "temperature must be >= 0.05");
  p = fmaas::Parameters();
  p.mutable_stopping()->set_max_new_tokens(500);
  p.mutable_decoding()->set_repetition_penalty(-1.0f);
  EXPECT_EQ(ErrorOf(p), "max_new_tokens must be <= 169");
  // Too many stop sequences is checked before token detail, an empty one after.
  p = fmaas::Parameters();
  p.mutable_response()->set_token_ranks(true);
  for (int i = 0; i < 7; ++i) p.mutable_stopping()->add_stop_sequences("s");
  EXPECT_EQ(ErrorOf(p),
            "can specify at most 6 non-empty stop sequences, each not more than 240 "
            "UTF8 bytes");
  p.mutable_stopping()->clear_stop_sequences();
  p.mutable_stopping()->add_stop_sequences("");
  EXPECT_EQ(ErrorOf(p),
            "must request input and/or generated tokens to request extra token "
            "detail");
}

TEST(RouterValidation, NanIsRejected) {
  fmaas::Parameters p = Sampling(std::nanf(""));
  EXPECT_EQ(ErrorOf(p), "temperature must be >= 0.05");
}

TEST(RouterValidation, TopNTokensIsNotCapped) {
  // TGIS's router passes top_n_tokens through; its shards cap it at the vocabulary size.
  fmaas::Parameters p;
  p.mutable_response()->set_generated_tokens(true);
  p.mutable_response()->set_top_n_tokens(9);
  EXPECT_EQ(Convert(p)->response.top_n_tokens, 9u);
}

TEST(RouterValidation, InputLength) {
  GenerationParams params;
  params.max_new_tokens = 100;
  absl::Status s = ValidateInput(200, 0, kLimits, 7, &params);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "input tokens (200) plus prefix length (0) must be < 200");

  params.min_new_tokens = 150;
  s = ValidateInput(69, 0, kLimits, 7, &params);
  EXPECT_EQ(s.message(),
            "input tokens (69) plus prefix length (0) plus min_new_tokens (150) must be <= 200");

  // Input + min == max is allowed; max_new_tokens is cut to fit and flagged.
  params.min_new_tokens = 2;
  params.max_new_tokens = 100;
  ASSERT_TRUE(ValidateInput(198, 0, kLimits, 7, &params).ok());
  EXPECT_EQ(params.max_new_tokens, 2u);
  EXPECT_TRUE(params.max_is_token_limit);

  GenerationParams fits;
  fits.max_new_tokens = 14;
  ASSERT_TRUE(ValidateInput(186, 0, kLimits, 7, &fits).ok());
  EXPECT_EQ(fits.max_new_tokens, 14u);
  EXPECT_FALSE(fits.max_is_token_limit);
}

TEST(RouterValidation, SamplingGetsASeed) {
  GenerationParams greedy;
  ASSERT_TRUE(ValidateInput(5, 0, kLimits, 1234, &greedy).ok());
  EXPECT_FALSE(greedy.seed.has_value());

  GenerationParams sample;
  sample.sample = true;
  ASSERT_TRUE(ValidateInput(5, 0, kLimits, 1234, &sample).ok());
  EXPECT_EQ(sample.seed, 1234u);

  GenerationParams seeded;
  seeded.sample = true;
  seeded.seed = 99;
  ASSERT_TRUE(ValidateInput(5, 0, kLimits, 1234, &seeded).ok());
  EXPECT_EQ(seeded.seed, 99u);
}

TEST(RouterValidation, PromptPrefix) {
  absl::Status s = PromptPrefixError(
      "invalid_prefix_id", absl::NotFoundError("prefix id \"invalid_prefix_id\" not found"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "can't retrieve prompt prefix with id 'invalid_prefix_id': prefix id "
            "\"invalid_prefix_id\" not found");
  // TGIS's ClientError wording of a shard that cannot be reached.
  s = PromptPrefixError("p", absl::UnavailableError("connection refused"));
  EXPECT_EQ(s.message(),
            "can't retrieve prompt prefix with id 'p': Could not connect to Text Generation "
            "server: connection refused");
  // The prefix length counts in the length checks.
  GenerationParams params;
  s = ValidateInput(190, 10, kLimits, 7, &params);
  EXPECT_EQ(s.message(), "input tokens (190) plus prefix length (10) must be < 200");
  params.max_new_tokens = 20;
  ASSERT_TRUE(ValidateInput(180, 10, kLimits, 7, &params).ok());
  EXPECT_EQ(params.max_new_tokens, 10u);
  EXPECT_TRUE(params.max_is_token_limit);
}

}  // namespace
}  // namespace tgis::router

// Guided decoding in the shard: which tokens a constraint allows, state by state, and how the
// sampler takes it (greedy and sampled choices stay inside it; a complete text ends even
// before min_new_tokens; no continuing token fails the choice).
#include "server/guided_decoding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/sampling.h"

namespace {

using tgis::server::Sampler;
using tgis::server::SamplingParams;
using tgis::server::TokenBytesTable;
using tgis::server::TokenConstraint;

constexpr int32_t kEos = 5;

std::shared_ptr<const tgis::server::GuidedVocabulary> Vocabulary() {
  // 4: a special token (no bytes); 5: EOS.
  return std::make_shared<const tgis::server::GuidedVocabulary>(
      TokenBytesTable{"a", "b", "ab", "c", "", "", "bc", "x"});
}

std::unique_ptr<TokenConstraint> Constraint(const char* pattern) {
  auto dfa = tgis::grammar::CompileRegex(pattern);
  EXPECT_TRUE(dfa.ok()) << dfa.status();
  return std::make_unique<TokenConstraint>(
      std::make_shared<tgis::server::GuidedAutomaton>(
          std::make_shared<const tgis::grammar::ByteDfa>(*dfa), Vocabulary()),
      std::vector<int32_t>{kEos});
}

std::vector<int> Allowed(TokenConstraint* c) {
  std::vector<float> logits(8, 1.0f);
  c->Mask(logits);
  std::vector<int> ids;
  for (int i = 0; i < 8; ++i) {
    if (std::isfinite(logits[i])) ids.push_back(i);
  }
  return ids;
}

// The vocabulary's trie walk (shared prefixes stepped once, rejected prefixes skipped) against
// the definition: each token's own walk of the automaton, for every state of several automata
// over a vocabulary of shared prefixes, duplicates, special tokens and multi-byte characters;
// and the word-at-a-time masking against the mask bit by bit, over a row whose last word is
// partial.
TEST(GuidedVocabulary, TrieMasksAreEachTokensOwnWalk) {
  std::mt19937 rng(7);
  const std::vector<std::string> pieces = {"a", "b", "c", "\"", " ", "{", "1", "\xc3\xa9", "}"};
  TokenBytesTable table;
  for (int i = 0; i < 3001; ++i) {
    std::string t;
    const int length = static_cast<int>(rng() % 7);  // 0: a special token
    for (int k = 0; k < length; ++k) t += pieces[rng() % pieces.size()];
    table.push_back(t);
  }
  table[17] = table[16];  // the same bytes twice
  const auto vocabulary = std::make_shared<const tgis::server::GuidedVocabulary>(table);
  for (const char* pattern :
       {"a+b?c*", "(ab|ba)*c", "[^a]{2,5}", "\\{\"a\": ?[0-9]+\\}", ".*é", "\"[a-c ]*\""}) {
    auto dfa = tgis::grammar::CompileRegex(pattern);
    ASSERT_TRUE(dfa.ok()) << pattern << ": " << dfa.status();
    auto shared = std::make_shared<const tgis::grammar::ByteDfa>(*dfa);
    for (int32_t state = 0; state < dfa->num_states(); ++state) {
      const std::vector<uint64_t> bits = vocabulary->Allowed(*dfa, state);
      ASSERT_EQ(bits.size(), (table.size() + 63) / 64);
      for (size_t id = 0; id < table.size(); ++id) {
        const bool want =
            !table[id].empty() && dfa->Walk(state, table[id]) != tgis::grammar::ByteDfa::kDead;
        ASSERT_EQ(((bits[id / 64] >> (id % 64)) & 1) == 1, want)
            << pattern << " state " << state << " token " << id;
      }
    }
    // Masking a row as the sampler does, from the start state after a few advances.
    TokenConstraint c(std::make_shared<tgis::server::GuidedAutomaton>(shared, vocabulary), {});
    for (int step = 0; step < 4; ++step) {
      std::vector<float> logits(table.size());
      for (float& x : logits) x = static_cast<float>(rng() % 1000) / 100.0f;
      const std::vector<float> before = logits;
      const std::vector<uint64_t> bits = vocabulary->Allowed(*dfa, c.state());
      const bool any = c.Mask(logits);
      bool want_any = false;
      for (size_t id = 0; id < table.size(); ++id) {
        const bool allowed = (bits[id / 64] >> (id % 64)) & 1;
        want_any = want_any || allowed;
        ASSERT_EQ(logits[id], allowed ? before[id] : -INFINITY) << pattern << " id " << id;
      }
      EXPECT_EQ(any, want_any);
      if (!any) break;
      int32_t pick = 0;
      while (!std::isfinite(logits[pick])) ++pick;
      c.Advance(pick);
    }
  }
}

TEST(TokenConstraint, AllowsTheTokensThatCanStillMatch) {
  auto c = Constraint("ab?c");
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{0, 2}));  // a, ab
  c->Advance(0);
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{1, 3, 6}));  // b, c, bc
  EXPECT_FALSE(c->MustEnd());
  c->Advance(1);
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{3}));
  c->Advance(3);
  EXPECT_TRUE(c->MustEnd());
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{kEos}));
}

TEST(TokenConstraint, EosOnlyWhereTheTextIsComplete) {
  auto c = Constraint("a(bc)*");
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{0, 2}));  // a, ab
  c->Advance(0);
  EXPECT_EQ(Allowed(c.get()), (std::vector<int>{1, kEos, 6}));  // b, EOS, bc
  EXPECT_FALSE(c->MustEnd());
}

TEST(GuidedSampler, GreedyAndSampledChoicesStayInside) {
  for (bool sample : {false, true}) {
    SamplingParams p;
    p.do_sample = sample;
    p.seed = 7;
    Sampler s(p, {kEos});
    s.SetConstraint(Constraint("(ab|x)c"));
    const Sampler::DeviceSteps d = s.ForDevice(0);
    EXPECT_FALSE(d.greedy);  // a constrained row is chosen on the host
    EXPECT_FALSE(d.from_top);
    // The most likely tokens are not allowed: b, c, then EOS; a (allowed: ab may follow) is
    // all but impossible.
    std::vector<float> logits = {-50.0f, 9.0f, 1.0f, 8.0f, 0.0f, 7.0f, 0.0f, 0.5f};
    const auto first = s.Next(logits, {}, 0, 2);
    EXPECT_TRUE(first.id == 2 || first.id == 7) << first.id;
    if (!sample) {
      EXPECT_EQ(first.id, 2);
      // The masked distribution's logprob: ab against x and a alone.
      EXPECT_NEAR(first.logprob, 1.0 - std::log(std::exp(1.0) + std::exp(0.5) + std::exp(-50.0)),
                  1e-5);
      ASSERT_EQ(first.top.size(), 2u);
      EXPECT_EQ(first.top[0].id, 2);
    }
    logits = {0.0f, 9.0f, 1.0f, 2.0f, 0.0f, 7.0f, 0.0f, 0.5f};
    EXPECT_EQ(s.Next(logits, {}, 1, 0).id, 3);
    logits = {0.0f, 9.0f, 1.0f, 2.0f, 0.0f, 7.0f, 0.0f, 0.5f};
    EXPECT_EQ(s.Next(logits, {}, 2, 0).id, kEos);
  }
}

TEST(GuidedSampler, ACompleteTextEndsBeforeMinNewTokens) {
  SamplingParams p;
  p.min_new_tokens = 10;
  Sampler s(p, {kEos});
  s.SetConstraint(Constraint("x"));
  std::vector<float> logits(8, 0.0f);
  EXPECT_EQ(s.Next(logits, {}, 0, 0).id, 7);
  logits.assign(8, 0.0f);
  EXPECT_EQ(s.Next(logits, {}, 1, 0).id, kEos);
}

TEST(GuidedSampler, NoContinuingTokenFailsTheChoice) {
  // No token of the vocabulary holds a 'z'.
  Sampler s(SamplingParams{}, {kEos});
  s.SetConstraint(Constraint("z+"));
  std::vector<float> logits(8, 0.0f);
  EXPECT_EQ(s.Next(logits, {}, 0, 0).id, -1);
}

}  // namespace

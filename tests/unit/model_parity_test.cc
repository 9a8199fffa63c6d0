// Parity with HF transformers: tiny seeded checkpoints saved by transformers itself
// (tests/fixtures/make_model_fixtures.py) with golden greedy continuations, per-step logprobs
// and prompt logprobs computed by transformers in float32.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/engine.h"
#include "server/model_config.h"
#include "server/model_registry.h"
#include "server/weights.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using tgis::server::Engine;
using tgis::server::NewSequence;
using tgis::server::StepOutput;
using tgis::server::SequenceError;

constexpr double kLogprobTolerance = 1e-4;

std::vector<std::string> ModelFixtures() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(TGIS_FIXTURES_DIR) / "models", ec)) {
    if (fs::exists(e.path() / "golden.json")) out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct Golden {
  std::vector<int32_t> input;
  std::vector<int32_t> generated;
  std::vector<double> logprobs;
  std::vector<double> prompt_logprobs;  // NaN for the first token
};

class ParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = (fs::path(TGIS_FIXTURES_DIR) / "models" / GetParam()).string();
    std::ifstream in(fs::path(dir_) / "golden.json");
    std::stringstream buf;
    buf << in.rdbuf();
    Json j = Json::parse(buf.str());
    for (const Json& p : j["prompts"]) {
      Golden g;
      g.input = p["input_ids"].get<std::vector<int32_t>>();
      g.generated = p["generated_ids"].get<std::vector<int32_t>>();
      g.logprobs = p["logprobs"].get<std::vector<double>>();
      for (const Json& v : p["prompt_logprobs"]) {
        g.prompt_logprobs.push_back(v.is_null() ? std::nan("") : v.get<double>());
      }
      goldens_.push_back(std::move(g));
    }
    ASSERT_FALSE(goldens_.empty());
  }

  std::unique_ptr<Engine> MakeEngine(int blocks = 256) {
    auto config = tgis::server::ModelConfig::Load(dir_);
    EXPECT_TRUE(config.ok()) << config.status();
    auto weights = tgis::server::WeightStore::Open(dir_);
    EXPECT_TRUE(weights.ok()) << weights.status();
    auto model = tgis::server::ModelRegistry::Get().Build(*config, **weights,
                                                          tgis::kernels::DType::kF32);
    EXPECT_TRUE(model.ok()) << model.status();
    weights_ = std::move(*weights);  // views into the mapped files must outlive the model
    return std::make_unique<Engine>(std::move(*model), config->eos_token_ids,
                                    config->max_position_embeddings, blocks, 4);
  }

  static NewSequence Seq(uint64_t id, const Golden& g, bool input_logprobs = false) {
    NewSequence n;
    n.id = id;
    n.input_ids = g.input;
    n.max_new_tokens = static_cast<uint32_t>(g.generated.size());
    n.input_logprobs = input_logprobs;
    return n;
  }

  std::string dir_;
  std::vector<Golden> goldens_;
  std::unique_ptr<tgis::server::WeightStore> weights_;
};

TEST_P(ParityTest, EachPromptAloneMatchesTransformers) {
  auto engine = MakeEngine();
  for (size_t i = 0; i < goldens_.size(); ++i) {
    const Golden& g = goldens_[i];
    std::vector<StepOutput> out;
    std::vector<SequenceError> errors;
    engine->Prefill({Seq(i, g, /*input_logprobs=*/true)}, &out, &errors);
    ASSERT_TRUE(errors.empty()) << errors[0].status;
    ASSERT_EQ(out.size(), 1u);
    // Prompt logprobs.
    ASSERT_EQ(out[0].input_tokens.size(), g.input.size());
    for (size_t p = 1; p < g.input.size(); ++p) {
      EXPECT_NEAR(out[0].input_tokens[p].logprob, g.prompt_logprobs[p], kLogprobTolerance)
          << "prompt " << i << " token " << p;
    }
    std::vector<int32_t> ids = {out[0].token.id};
    std::vector<double> lps = {out[0].token.logprob};
    while (ids.size() < g.generated.size()) {
      out.clear();
      engine->Decode({i}, &out, &errors);
      ASSERT_TRUE(errors.empty()) << errors[0].status;
      ids.push_back(out[0].token.id);
      lps.push_back(out[0].token.logprob);
    }
    EXPECT_EQ(ids, g.generated) << "prompt " << i;
    for (size_t k = 0; k < lps.size(); ++k) {
      EXPECT_NEAR(lps[k], g.logprobs[k], kLogprobTolerance) << "prompt " << i << " step " << k;
    }
    engine->Release(i);
  }
  EXPECT_EQ(engine->free_blocks(), engine->num_blocks());
}

TEST_P(ParityTest, AllPromptsInOneRaggedBatch) {
  auto engine = MakeEngine();
  std::vector<NewSequence> seqs;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < goldens_.size(); ++i) {
    seqs.push_back(Seq(i, goldens_[i]));
    ids.push_back(i);
  }
  std::vector<StepOutput> out;
  std::vector<SequenceError> errors;
  engine->Prefill(std::move(seqs), &out, &errors);
  ASSERT_TRUE(errors.empty());
  std::vector<std::vector<int32_t>> got(goldens_.size());
  std::vector<std::vector<double>> lps(goldens_.size());
  size_t steps = 0;
  for (const Golden& g : goldens_) steps = std::max(steps, g.generated.size());
  for (size_t step = 0; step < steps; ++step) {
    for (const StepOutput& o : out) {
      got[o.id].push_back(o.token.id);
      lps[o.id].push_back(o.token.logprob);
    }
    // Sequences leave the batch when they have all their tokens.
    std::vector<uint64_t> live;
    for (uint64_t id : ids) {
      if (got[id].size() < goldens_[id].generated.size()) {
        live.push_back(id);
      } else {
        engine->Release(id);
      }
    }
    ids = live;
    if (ids.empty()) break;
    out.clear();
    engine->Decode(ids, &out, &errors);
    ASSERT_TRUE(errors.empty());
  }
  for (size_t i = 0; i < goldens_.size(); ++i) {
    EXPECT_EQ(got[i], goldens_[i].generated) << "prompt " << i;
    for (size_t k = 0; k < lps[i].size(); ++k) {
      EXPECT_NEAR(lps[i][k], goldens_[i].logprobs[k], kLogprobTolerance);
    }
  }
}

TEST_P(ParityTest, IdsDoNotChangeWhenOthersJoinOrLeave) {
  if (goldens_.size() < 2) GTEST_SKIP() << "needs two prompts";
  auto engine = MakeEngine();
  const Golden& a = goldens_.back();
  std::vector<StepOutput> out;
  std::vector<SequenceError> errors;
  engine->Prefill({Seq(100, a)}, &out, &errors);
  std::vector<int32_t> ids = {out[0].token.id};
  size_t step = 0;
  bool others = false;
  while (ids.size() < a.generated.size()) {
    ++step;
    if (step == 2) {  // others join
      out.clear();
      engine->Prefill({Seq(200, goldens_[0]), Seq(201, goldens_[1])}, &out, &errors);
      others = true;
    }
    if (step == 5) {  // one leaves
      engine->Release(200);
    }
    std::vector<uint64_t> batch = {100};
    if (others && engine->Has(201)) batch.push_back(201);
    if (others && engine->Has(200)) batch.push_back(200);
    out.clear();
    engine->Decode(batch, &out, &errors);
    ASSERT_TRUE(errors.empty());
    for (const StepOutput& o : out) {
      if (o.id == 100) ids.push_back(o.token.id);
    }
  }
  EXPECT_EQ(ids, a.generated);
}

TEST_P(ParityTest, OutOfBlocksIsReportedNotFatal) {
  auto engine = MakeEngine(/*blocks=*/2);  // 8 token slots
  const Golden& longest = *std::max_element(
      goldens_.begin(), goldens_.end(),
      [](const Golden& x, const Golden& y) { return x.input.size() < y.input.size(); });
  if (longest.input.size() <= 8) GTEST_SKIP() << "no prompt longer than the cache";
  std::vector<StepOutput> out;
  std::vector<SequenceError> errors;
  engine->Prefill({Seq(1, longest)}, &out, &errors);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(engine->free_blocks(), 2);
}

INSTANTIATE_TEST_SUITE_P(Models, ParityTest, ::testing::ValuesIn(ModelFixtures()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ParityTest);

}  // namespace

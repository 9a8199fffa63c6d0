// The Prometheus text exposition of the tgi_ metric set.
#include <gtest/gtest.h>

#include <regex>
#include <set>

#include "metrics/http_server.h"
#include "metrics/registry.h"
#include "metrics/tgi_metrics.h"

namespace {

using tgis::metrics::HttpServer;
using tgis::metrics::Registry;
using tgis::metrics::TgiMetrics;

std::set<std::pair<std::string, std::string>> Types(const std::string& text) {
  std::set<std::pair<std::string, std::string>> out;
  std::regex re("# TYPE (\\S+) (\\S+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it) {
    out.insert({(*it)[1], (*it)[2]});
  }
  return out;
}

TEST(Metrics, EveryTgisMetricIsExposedWithItsKind) {
  Registry r;
  TgiMetrics m(&r);
  const auto types = Types(r.Render());
  const std::vector<std::pair<std::string, std::string>> want = {
      {"tgi_request_count", "counter"},
      {"tgi_request_input_count", "counter"},
      {"tgi_request_failure", "counter"},
      {"tgi_request_success", "counter"},
      {"tgi_request_max_new_tokens", "histogram"},
      {"tgi_request_input_length", "histogram"},
      {"tgi_request_raw_input_length", "summary"},
      {"tgi_request_mean_time_per_token_duration", "histogram"},
      {"tgi_request_validation_duration", "histogram"},
      {"tgi_request_queue_duration", "histogram"},
      {"tgi_request_generated_tokens", "histogram"},
      {"tgi_request_total_tokens", "histogram"},
      {"tgi_request_duration", "histogram"},
      {"tgi_request_inference_duration", "histogram"},
      {"tgi_batch_concatenation_count", "counter"},
      {"tgi_batch_inference_count", "counter"},
      {"tgi_batch_inference_success", "counter"},
      {"tgi_batch_inference_failure", "counter"},
      {"tgi_batch_inference_batch_size", "histogram"},
      {"tgi_batch_inference_duration", "histogram"},
      {"tgi_batch_inference_forward_duration", "histogram"},
      {"tgi_batch_inference_tokproc_duration", "histogram"},
      {"tgi_batch_next_tokens", "summary"},
      {"tgi_batch_current_size", "gauge"},
      {"tgi_batch_input_tokens", "gauge"},
      {"tgi_batch_max_remaining_tokens", "gauge"},
      {"tgi_queue_size", "gauge"},
      {"tgi_queue_jump", "counter"},
      {"tgi_granular_batch_addition", "counter"},
      {"tgi_prefill_weight_limit_exceeded", "counter"},
      {"tgi_prefill_padding_limit_exceeded", "counter"},
      {"tgi_prompt_load_failure", "counter"},
      {"tgi_prompt_load_duration", "histogram"},
      {"tgi_tokenize_request_count", "counter"},
      {"tgi_tokenize_request_input_count", "counter"},
      {"tgi_tokenize_request_tokens", "histogram"},
      {"tgi_tokenize_request_duration", "histogram"}};
  for (const auto& [name, kind] : want) {
    EXPECT_TRUE(types.count({name, kind})) << name << " " << kind;
    if (kind == "counter") {
      EXPECT_TRUE(types.count({name + "_total", kind})) << name << "_total";
    }
  }
}

// Ours, beside TGIS's set, are named as Prometheus wants counters: once, ending in _total.
TEST(Metrics, OurCountersEndInTotalOnce) {
  Registry r;
  TgiMetrics m(&r);
  const auto types = Types(r.Render());
  for (const std::string name :
       {"tgis_prefix_cache_hits_total", "tgis_prefix_cache_reused_tokens_total",
        "tgis_preemptions_total", "tgis_draft_tokens_total", "tgis_accepted_draft_tokens_total"}) {
    EXPECT_TRUE(types.count({name, "counter"})) << name;
    EXPECT_FALSE(types.count({name + "_total", "counter"})) << name;
  }
}

TEST(Metrics, LabelledCounterAndHistogramRender) {
  Registry r;
  TgiMetrics m(&r);
  m.request_success->Add(1, {"EOS_TOKEN", "single"});
  m.request_success->Add(2, {"EOS_TOKEN", "single"});
  m.batch_inference_duration->Observe(0.0011, {"prefill", "1"});
  m.batch_inference_duration->Observe(100, {"prefill", "1"});
  m.queue_size->Set(4);
  const std::string text = r.Render();
  EXPECT_NE(text.find("tgi_request_success{stop_reason=\"EOS_TOKEN\",kind=\"single\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("tgi_request_success_total{stop_reason=\"EOS_TOKEN\",kind=\"single\"} 3\n"),
            std::string::npos);
  EXPECT_NE(
      text.find(
          "tgi_batch_inference_duration_bucket{method=\"prefill\",makeup=\"1\",le=\"0.000759375\"} "
          "0\n"),
      std::string::npos);
  EXPECT_NE(text.find("tgi_batch_inference_duration_bucket{method=\"prefill\",makeup=\"1\",le=\"0."
                      "0011390624999999999\"} 1\n"),
            std::string::npos);
  EXPECT_NE(
      text.find(
          "tgi_batch_inference_duration_bucket{method=\"prefill\",makeup=\"1\",le=\"+Inf\"} 2\n"),
      std::string::npos);
  EXPECT_NE(text.find("tgi_batch_inference_duration_count{method=\"prefill\",makeup=\"1\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("tgi_queue_size 4\n"), std::string::npos);
  EXPECT_EQ(m.request_success->Value({"EOS_TOKEN", "single"}), 3);
}

// TGIS's router (server.rs) sets these buckets; dashboards built on them must keep working.
TEST(Metrics, BucketsAreTgisBuckets) {
  // Durations: value = 0.0001, then 35 times value *= 1.5, each pushed (as TGIS computes them,
  // so the doubles and their shortest text are the same).
  std::vector<double> want;
  double value = 0.0001;
  for (int i = 0; i < 35; ++i) want.push_back(value *= 1.5);
  EXPECT_EQ(tgis::metrics::DurationBuckets(), want);

  Registry r;
  TgiMetrics m(&r, {.max_sequence_length = 200, .max_new_tokens = 169, .max_batch_size = 8});
  const std::string text = r.Render();
  auto has = [&text](const std::string& line) { return text.find(line) != std::string::npos; };
  // Tokenize: 2^6 .. 2^19.
  EXPECT_TRUE(has("tgi_tokenize_request_tokens_bucket{le=\"64\"} 0\n"));
  EXPECT_TRUE(has("tgi_tokenize_request_tokens_bucket{le=\"524288\"} 0\n"));
  EXPECT_FALSE(has("tgi_tokenize_request_tokens_bucket{le=\"32\"}"));
  EXPECT_FALSE(has("tgi_tokenize_request_tokens_bucket{le=\"1048576\"}"));
  // Lengths: 64 linear steps of max_sequence_length / 64 or max_new_tokens / 64.
  EXPECT_TRUE(has("tgi_request_input_length_bucket{le=\"3.125\"} 0\n"));
  EXPECT_TRUE(has("tgi_request_input_length_bucket{le=\"200\"} 0\n"));
  EXPECT_TRUE(has("tgi_request_total_tokens_bucket{le=\"6.25\"} 0\n"));
  EXPECT_TRUE(has("tgi_request_generated_tokens_bucket{le=\"2.640625\"} 0\n"));
  EXPECT_TRUE(has("tgi_request_max_new_tokens_bucket{le=\"169\"} 0\n"));
  EXPECT_EQ(tgis::metrics::LinearBuckets(200).size(), 64u);
  // Batch sizes 1..MAX_BATCH_SIZE (labelled by method, so shown once observed).
  m.batch_inference_batch_size->Observe(3, {"prefill"});
  const std::string after = r.Render();
  EXPECT_NE(after.find("tgi_batch_inference_batch_size_bucket{method=\"prefill\",le=\"8\"} 1\n"),
            std::string::npos);
  EXPECT_EQ(after.find("tgi_batch_inference_batch_size_bucket{method=\"prefill\",le=\"9\"}"),
            std::string::npos);

  // Reshape, once the shards told the real limits, replaces the buckets.
  m.Reshape({.max_sequence_length = 128, .max_new_tokens = 64, .max_batch_size = 2});
  const std::string reshaped = r.Render();
  EXPECT_NE(reshaped.find("tgi_request_input_length_bucket{le=\"2\"} 0\n"), std::string::npos);
  EXPECT_NE(reshaped.find("tgi_request_max_new_tokens_bucket{le=\"1\"} 0\n"), std::string::npos);
  EXPECT_EQ(reshaped.find("tgi_request_input_length_bucket{le=\"200\"}"), std::string::npos);
}

// tgi_batch_next_tokens and tgi_request_raw_input_length have no buckets in TGIS, so its
// exporter renders them as summaries.
TEST(Metrics, SummariesRenderQuantilesSumAndCount) {
  Registry r;
  TgiMetrics m(&r);
  EXPECT_NE(r.Render().find("tgi_batch_next_tokens_count 0\n"), std::string::npos);
  for (int v = 1; v <= 100; ++v) m.batch_next_tokens->Observe(v);
  const std::string text = r.Render();
  for (const char* line :
       {"tgi_batch_next_tokens{quantile=\"0\"} 1\n", "tgi_batch_next_tokens{quantile=\"0.5\"} 50\n",
        "tgi_batch_next_tokens{quantile=\"0.9\"} 90\n",
        "tgi_batch_next_tokens{quantile=\"0.99\"} 99\n",
        "tgi_batch_next_tokens{quantile=\"1\"} 100\n", "tgi_batch_next_tokens_sum 5050\n",
        "tgi_batch_next_tokens_count 100\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << text;
  }
  EXPECT_EQ(m.batch_next_tokens->Value(), 100);
}

TEST(Metrics, LabelValuesAreEscaped) {
  Registry r;
  auto* f = r.Counter("tgi_request_failure", "failures", {"err"});
  f->Add(1, {"say \"hi\"\\n"});
  EXPECT_NE(r.Render().find("tgi_request_failure{err=\"say \\\"hi\\\"\\\\n\"} 1"),
            std::string::npos);
}

TEST(Metrics, ValuesAreShortest) {
  Registry r;
  auto* h = r.Histogram("tgi_x", "x", {0.004, 0.1, 1e20});
  h->Observe(0.3);
  const std::string text = r.Render();
  EXPECT_NE(text.find("tgi_x_bucket{le=\"0.004\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("tgi_x_bucket{le=\"0.1\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("tgi_x_bucket{le=\"1e+20\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("tgi_x_sum 0.3\n"), std::string::npos) << text;
}

TEST(HttpServer, PortInUseFails) {
  HttpServer first([] { return true; }, [] { return std::string(); });
  ASSERT_TRUE(first.Start(0));
  ASSERT_GT(first.port(), 0);
  // Another server may not share the port (no SO_REUSEPORT).
  HttpServer second([] { return true; }, [] { return std::string(); });
  EXPECT_FALSE(second.Start(first.port()));
  EXPECT_NE(second.error().find("in use"), std::string::npos) << second.error();
}

}  // namespace

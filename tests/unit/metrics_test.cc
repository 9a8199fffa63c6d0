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
      {"tgi_request_raw_input_length", "histogram"},
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
      {"tgi_batch_next_tokens", "histogram"},
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
    if (kind == "counter") EXPECT_TRUE(types.count({name + "_total", kind})) << name << "_total";
  }
}

TEST(Metrics, LabelledCounterAndHistogramRender) {
  Registry r;
  TgiMetrics m(&r);
  m.request_success->Add(1, {"EOS_TOKEN", "single"});
  m.request_success->Add(2, {"EOS_TOKEN", "single"});
  m.batch_inference_duration->Observe(0.0015, {"prefill", "1"});
  m.batch_inference_duration->Observe(100, {"prefill", "1"});
  m.queue_size->Set(4);
  const std::string text = r.Render();
  EXPECT_NE(text.find("tgi_request_success{stop_reason=\"EOS_TOKEN\",kind=\"single\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("tgi_request_success_total{stop_reason=\"EOS_TOKEN\",kind=\"single\"} 3\n"),
            std::string::npos);
  EXPECT_NE(
      text.find(
          "tgi_batch_inference_duration_bucket{method=\"prefill\",makeup=\"1\",le=\"0.001\"} 0\n"),
      std::string::npos);
  EXPECT_NE(
      text.find(
          "tgi_batch_inference_duration_bucket{method=\"prefill\",makeup=\"1\",le=\"0.002\"} 1\n"),
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

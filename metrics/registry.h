// A small Prometheus registry: counters, gauges and histograms with labels, rendered in the
// text exposition format (0.0.4). prometheus-cpp is not packaged for Debian 12; this is the
// part of it the server needs, in one module.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tgis::metrics {

enum class Kind { kCounter, kGauge, kHistogram, kSummary };

using LabelValues = std::vector<std::string>;

class Family {
 public:
  Family(std::string name, std::string help, Kind kind, std::vector<std::string> label_names,
         std::vector<double> buckets);

  // Counter / gauge.
  void Add(double v, const LabelValues& labels = {});
  void Set(double v, const LabelValues& labels = {});
  // Histogram / summary.
  void Observe(double v, const LabelValues& labels = {});
  // Histogram: new upper bounds, dropping what was observed (for shapes known only once the
  // shards have answered, before any observation).
  void SetBuckets(std::vector<double> buckets);

  // Current value of a counter or gauge child, or a histogram or summary child's count.
  double Value(const LabelValues& labels = {}) const;

  const std::string& name() const { return name_; }
  Kind kind() const { return kind_; }
  void Render(const std::string& exposed_name, std::string* out) const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Child {
    double value = 0;                     // counter/gauge; histogram and summary sum
    std::vector<uint64_t> bucket_counts;  // histogram, per upper bound (not cumulative)
    uint64_t count = 0;
    std::deque<std::pair<Clock::time_point, double>> recent;  // summary: the window's values
  };
  Child& ChildFor(const LabelValues& labels);

  std::string name_, help_;
  Kind kind_;
  std::vector<std::string> label_names_;
  std::vector<double> buckets_;  // histogram upper bounds, or summary quantiles
  mutable std::mutex mu_;
  mutable std::map<LabelValues, Child> children_;  // Render prunes summary windows
};

class Registry {
 public:
  Family* Counter(const std::string& name, const std::string& help,
                  std::vector<std::string> labels = {});
  Family* Gauge(const std::string& name, const std::string& help,
                std::vector<std::string> labels = {});
  Family* Histogram(const std::string& name, const std::string& help, std::vector<double> buckets,
                    std::vector<std::string> labels = {});
  // Quantiles over the last kSummaryWindow of observations (sum and count over all time), as
  // TGIS's exporter renders a histogram it has no buckets for.
  Family* Summary(const std::string& name, const std::string& help,
                  std::vector<std::string> labels = {});
  // Every family in registration order; counters also once more with the _total suffix (TGIS
  // dashboards query both spellings), unless their name ends in _total already.
  std::string Render() const;

 private:
  std::vector<std::unique_ptr<Family>> families_;
};

// The quantiles a summary reports (metrics-exporter-prometheus's defaults, which TGIS uses),
// and the window they are computed over (its 3 buckets of 20 s).
inline const std::vector<double> kSummaryQuantiles = {0, 0.5, 0.9, 0.95, 0.99, 0.999, 1};
inline constexpr std::chrono::seconds kSummaryWindow{60};
// The most observations a summary child keeps for its quantiles.
inline constexpr size_t kSummaryMaxSamples = 1 << 16;

// Buckets: start, start*factor, ... (count of them).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace tgis::metrics

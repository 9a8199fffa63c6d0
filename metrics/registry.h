// A small Prometheus registry: counters, gauges and histograms with labels, rendered in the
// text exposition format (0.0.4). prometheus-cpp is not packaged for Debian 12; this is the
// part of it the server needs, in one module.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tgis::metrics {

enum class Kind { kCounter, kGauge, kHistogram };

using LabelValues = std::vector<std::string>;

class Family {
 public:
  Family(std::string name, std::string help, Kind kind, std::vector<std::string> label_names,
         std::vector<double> buckets);

  // Counter / gauge.
  void Add(double v, const LabelValues& labels = {});
  void Set(double v, const LabelValues& labels = {});
  // Histogram.
  void Observe(double v, const LabelValues& labels = {});

  // Current value of a counter or gauge child, or a histogram child's count (for tests).
  double Value(const LabelValues& labels = {}) const;

  const std::string& name() const { return name_; }
  Kind kind() const { return kind_; }
  void Render(const std::string& exposed_name, std::string* out) const;

 private:
  struct Child {
    double value = 0;                     // counter/gauge; histogram sum
    std::vector<uint64_t> bucket_counts;  // histogram, per upper bound (not cumulative)
    uint64_t count = 0;
  };
  Child& ChildFor(const LabelValues& labels);

  std::string name_, help_;
  Kind kind_;
  std::vector<std::string> label_names_;
  std::vector<double> buckets_;
  mutable std::mutex mu_;
  std::map<LabelValues, Child> children_;
};

class Registry {
 public:
  Family* Counter(const std::string& name, const std::string& help,
                  std::vector<std::string> labels = {});
  Family* Gauge(const std::string& name, const std::string& help,
                std::vector<std::string> labels = {});
  Family* Histogram(const std::string& name, const std::string& help, std::vector<double> buckets,
                    std::vector<std::string> labels = {});
  // Every family in registration order; counters also once more with the _total suffix (TGIS
  // dashboards query both spellings).
  std::string Render() const;

 private:
  std::vector<std::unique_ptr<Family>> families_;
};

// Buckets: start, start*factor, ... (count of them).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace tgis::metrics

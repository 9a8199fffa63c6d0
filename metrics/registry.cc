#include "metrics/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace tgis::metrics {
namespace {

std::string FormatValue(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  // The shortest text that reads back as the same double: 0.004, not 0.0040000000000000001.
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string Labels(const std::vector<std::string>& names, const LabelValues& values,
                   const std::string& extra_name = "", const std::string& extra_value = "") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!out.empty()) out += ",";
    out += names[i] + "=\"" + Escape(i < values.size() ? values[i] : "") + "\"";
  }
  if (!extra_name.empty()) {
    if (!out.empty()) out += ",";
    out += extra_name + "=\"" + extra_value + "\"";
  }
  return out.empty() ? "" : "{" + out + "}";
}

}  // namespace

Family::Family(std::string name, std::string help, Kind kind, std::vector<std::string> label_names,
               std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      kind_(kind),
      label_names_(std::move(label_names)),
      buckets_(std::move(buckets)) {}

Family::Child& Family::ChildFor(const LabelValues& labels) {
  auto it = children_.find(labels);
  if (it == children_.end()) {
    Child c;
    c.bucket_counts.assign(buckets_.size(), 0);
    it = children_.emplace(labels, std::move(c)).first;
  }
  return it->second;
}

void Family::Add(double v, const LabelValues& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  ChildFor(labels).value += v;
}

void Family::Set(double v, const LabelValues& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  ChildFor(labels).value = v;
}

void Family::Observe(double v, const LabelValues& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Child& c = ChildFor(labels);
  c.value += v;
  c.count += 1;
  if (kind_ == Kind::kSummary) {
    c.recent.emplace_back(Clock::now(), v);
    if (c.recent.size() > kSummaryMaxSamples) c.recent.pop_front();
    return;
  }
  auto it = std::lower_bound(buckets_.begin(), buckets_.end(), v);
  if (it != buckets_.end()) c.bucket_counts[it - buckets_.begin()] += 1;
}

void Family::SetBuckets(std::vector<double> buckets) {
  std::lock_guard<std::mutex> lock(mu_);
  buckets_ = std::move(buckets);
  children_.clear();
}

double Family::Value(const LabelValues& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(labels);
  if (it == children_.end()) return 0;
  const bool counted = kind_ == Kind::kHistogram || kind_ == Kind::kSummary;
  return counted ? static_cast<double>(it->second.count) : it->second.value;
}

void Family::Render(const std::string& exposed, std::string* out) const {
  static const char* kTypes[] = {"counter", "gauge", "histogram", "summary"};
  *out += "# HELP " + exposed + " " + help_ + "\n";
  *out += "# TYPE " + exposed + " " + kTypes[static_cast<int>(kind_)] + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  // A family without labels shows its zero value before anything happened.
  if (children_.empty() && label_names_.empty()) {
    if (kind_ == Kind::kSummary) {
      *out += exposed + "_sum 0\n" + exposed + "_count 0\n";
    } else if (kind_ == Kind::kHistogram) {
      for (double b : buckets_) *out += exposed + "_bucket{le=\"" + FormatValue(b) + "\"} 0\n";
      *out += exposed + "_bucket{le=\"+Inf\"} 0\n" + exposed + "_sum 0\n" + exposed + "_count 0\n";
    } else {
      *out += exposed + " 0\n";
    }
    return;
  }
  const auto window_start = Clock::now() - kSummaryWindow;
  for (auto& [values, c] : children_) {
    if (kind_ == Kind::kSummary) {
      while (!c.recent.empty() && c.recent.front().first < window_start) c.recent.pop_front();
      std::vector<double> sorted;
      for (const auto& [at, v] : c.recent) sorted.push_back(v);
      std::sort(sorted.begin(), sorted.end());
      // Nothing in the window: no quantile lines, as the exporter prints none then.
      for (double q : sorted.empty() ? std::vector<double>{} : buckets_) {
        const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
        const double v = sorted[rank == 0 ? 0 : rank - 1];
        *out += exposed + Labels(label_names_, values, "quantile", FormatValue(q)) + " " +
                FormatValue(v) + "\n";
      }
      *out += exposed + "_sum" + Labels(label_names_, values) + " " + FormatValue(c.value) + "\n";
      *out +=
          exposed + "_count" + Labels(label_names_, values) + " " + std::to_string(c.count) + "\n";
      continue;
    }
    if (kind_ != Kind::kHistogram) {
      *out += exposed + Labels(label_names_, values) + " " + FormatValue(c.value) + "\n";
      continue;
    }
    uint64_t cumulative = 0;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      cumulative += c.bucket_counts[i];
      *out += exposed + "_bucket" + Labels(label_names_, values, "le", FormatValue(buckets_[i])) +
              " " + std::to_string(cumulative) + "\n";
    }
    *out += exposed + "_bucket" + Labels(label_names_, values, "le", "+Inf") + " " +
            std::to_string(c.count) + "\n";
    *out += exposed + "_sum" + Labels(label_names_, values) + " " + FormatValue(c.value) + "\n";
    *out +=
        exposed + "_count" + Labels(label_names_, values) + " " + std::to_string(c.count) + "\n";
  }
}

Family* Registry::Counter(const std::string& name, const std::string& help,
                          std::vector<std::string> labels) {
  families_.push_back(std::make_unique<Family>(name, help, Kind::kCounter, std::move(labels),
                                               std::vector<double>{}));
  return families_.back().get();
}

Family* Registry::Gauge(const std::string& name, const std::string& help,
                        std::vector<std::string> labels) {
  families_.push_back(
      std::make_unique<Family>(name, help, Kind::kGauge, std::move(labels), std::vector<double>{}));
  return families_.back().get();
}

Family* Registry::Histogram(const std::string& name, const std::string& help,
                            std::vector<double> buckets, std::vector<std::string> labels) {
  families_.push_back(std::make_unique<Family>(name, help, Kind::kHistogram, std::move(labels),
                                               std::move(buckets)));
  return families_.back().get();
}

Family* Registry::Summary(const std::string& name, const std::string& help,
                          std::vector<std::string> labels) {
  families_.push_back(
      std::make_unique<Family>(name, help, Kind::kSummary, std::move(labels), kSummaryQuantiles));
  return families_.back().get();
}

std::string Registry::Render() const {
  std::string out;
  for (const auto& f : families_) {
    f->Render(f->name(), &out);
    // Ours are named as Prometheus wants (…_total) and need no second spelling.
    const bool has_total = f->name().ends_with("_total");
    if (f->kind() == Kind::kCounter && !has_total) f->Render(f->name() + "_total", &out);
  }
  return out;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < count; ++i) {
    b.push_back(v);
    v *= factor;
  }
  return b;
}

}  // namespace tgis::metrics

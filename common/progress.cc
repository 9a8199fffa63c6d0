#include "common/progress.h"

#include <glog/logging.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace tgis {
namespace {

std::chrono::milliseconds DefaultInterval() {
  if (const char* v = std::getenv("TGIS_PROGRESS_INTERVAL"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const double s = std::strtod(v, &end);
    if (end != v && *end == '\0' && s >= 0) {
      return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
    }
    LOG(WARNING) << "TGIS_PROGRESS_INTERVAL='" << v << "' is not a number of seconds; using 5";
  }
  return std::chrono::seconds(5);
}

std::string FormatSeconds(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.0fs", std::ceil(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600,
                  static_cast<int>(s) / 60 % 60);
  }
  return buf;
}

}  // namespace

Progress::Progress(std::string what, int64_t total_bytes, int total_files, Sink sink,
                   std::chrono::milliseconds interval)
    : what_(std::move(what)),
      sink_(sink ? std::move(sink) : [](const std::string& line) { LOG(INFO) << line; }),
      interval_(interval.count() < 0 ? DefaultInterval() : interval),
      total_bytes_(total_bytes),
      total_files_(total_files),
      start_(Clock::now()),
      last_line_(start_) {}

void Progress::AddBytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += bytes;
  MaybeLogLocked();
}

void Progress::FileDone() {
  std::lock_guard<std::mutex> lock(mu_);
  ++files_;
  MaybeLogLocked();
}

void Progress::AddTotalBytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  total_bytes_ += bytes;
}

int64_t Progress::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

void Progress::MaybeLogLocked() {
  const Clock::time_point now = Clock::now();
  if (finished_ || now - last_line_ < interval_) return;
  last_line_ = now;
  sink_(LineLocked(now));
}

void Progress::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
  char rate[64] = "";
  if (secs > 0) {
    std::snprintf(rate, sizeof rate, ", %s/s", FormatBytes(bytes_ / secs).c_str());
  }
  char time[32];
  std::snprintf(time, sizeof time, "%.1fs", secs);
  std::string line = what_ + ": done, ";
  if (total_files_ > 0 || files_ > 0) line += std::to_string(files_) + " files, ";
  sink_(line + FormatBytes(static_cast<double>(bytes_)) + " in " + time + rate);
}

std::string Progress::Line() const {
  std::lock_guard<std::mutex> lock(mu_);
  return LineLocked(Clock::now());
}

std::string Progress::LineLocked(Clock::time_point now) const {
  std::string line = what_ + ": ";
  if (total_files_ > 0) {
    line += std::to_string(files_) + "/" + std::to_string(total_files_) + " files, ";
  }
  line += FormatBytes(static_cast<double>(bytes_));
  if (total_bytes_ > 0) {
    char pct[32];
    std::snprintf(pct, sizeof pct, " (%.0f%%)", 100.0 * bytes_ / total_bytes_);
    line += " of " + FormatBytes(static_cast<double>(total_bytes_)) + pct;
  }
  const double secs = std::chrono::duration<double>(now - start_).count();
  if (secs > 0 && bytes_ > 0) {
    const double rate = bytes_ / secs;
    line += ", " + FormatBytes(rate) + "/s";
    if (total_bytes_ > bytes_) line += ", ETA " + FormatSeconds((total_bytes_ - bytes_) / rate);
  }
  return line;
}

std::string Progress::FormatBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  } else {
    std::snprintf(buf, sizeof buf, bytes < 10 ? "%.2f %s" : "%.1f %s", bytes, kUnits[u]);
  }
  return buf;
}

}  // namespace tgis

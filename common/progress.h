// Progress of a long job (weights loading, a download, a conversion) as log lines: bytes and
// files done of the total, rate and ETA, at most one line per interval so that a 16 GB load
// shows steady progress instead of a flood. Lines go through glog (so JSON_OUTPUT wraps them
// like any other line). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace tgis {

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  using Sink = std::function<void(const std::string&)>;

  // `total_bytes` or `total_files` may be 0 when unknown. `sink`: where lines go (default:
  // LOG(INFO)). `interval`: the least time between two lines (TGIS_PROGRESS_INTERVAL seconds
  // from the environment when not given, else 5 s).
  Progress(std::string what, int64_t total_bytes, int total_files, Sink sink = nullptr,
           std::chrono::milliseconds interval = std::chrono::milliseconds(-1));

  void AddBytes(int64_t bytes);
  void FileDone();
  void AddTotalBytes(int64_t bytes);
  // The closing line (done, bytes, time, mean rate), whatever the interval.
  void Finish();
  int64_t bytes() const;

  // "1.50 GiB", "12.0 MiB", "512 B".
  static std::string FormatBytes(double bytes);
  // The line as it would be printed now (for tests).
  std::string Line() const;

 private:
  std::string LineLocked(Clock::time_point now) const;
  void MaybeLogLocked();

  const std::string what_;
  Sink sink_;
  std::chrono::milliseconds interval_;
  mutable std::mutex mu_;
  int64_t total_bytes_;
  int total_files_;
  int64_t bytes_ = 0;
  int files_ = 0;
  Clock::time_point start_;
  Clock::time_point last_line_;
  bool finished_ = false;
};

}  // namespace tgis

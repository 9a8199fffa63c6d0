#include "launcher/log_sink.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>

namespace tgis::launcher {

namespace {
std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm;
  gmtime_r(&t, &tm);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  return buf;
}
}  // namespace

void LogSink::Child(const std::string& name, const std::string& line) {
  // glog lines start with a severity letter (I/W/E/F) followed by the date.
  const char* level = "INFO";
  if (line.size() > 1 && line[1] >= '0' && line[1] <= '9') {
    if (line[0] == 'W') level = "WARN";
    if (line[0] == 'E') level = "ERROR";
    if (line[0] == 'F') level = "FATAL";
  }
  Write(level, name, line);
}

void LogSink::Write(const char* level, const std::string& target, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (json_) {
    nlohmann::json j = {{"timestamp", Timestamp()},
                        {"level", level},
                        {"target", target},
                        {"fields", {{"message", message}}}};
    std::fprintf(stdout, "%s\n",
                 j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::fprintf(stdout, "%s %-5s [%s] %s\n", Timestamp().c_str(), level, target.c_str(),
                 message.c_str());
  }
  std::fflush(stdout);
}

}  // namespace tgis::launcher

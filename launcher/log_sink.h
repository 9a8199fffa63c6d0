// The launcher's log output: its own messages and every line its children print, either as
// plain "[name] line" text or, with JSON_OUTPUT, as one JSON object per line.
#pragma once

#include <mutex>
#include <string>

namespace tgis::launcher {

class LogSink {
 public:
  explicit LogSink(bool json) : json_(json) {}
  void Info(const std::string& message) { Write("INFO", "launcher", message); }
  void Warn(const std::string& message) { Write("WARN", "launcher", message); }
  void Error(const std::string& message) { Write("ERROR", "launcher", message); }
  // A line a child printed.
  void Child(const std::string& name, const std::string& line);

 private:
  void Write(const char* level, const std::string& target, const std::string& message);
  bool json_;
  std::mutex mu_;
};

}  // namespace tgis::launcher

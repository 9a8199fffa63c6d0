// Children of the launcher: started with their output piped back (so it can be logged as
// JSON), a parent-death signal (no orphan survives the launcher, even a SIGKILLed one), and
// their own process group.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace tgis::launcher {

class ChildProcess {
 public:
  using LineSink = std::function<void(const std::string& name, const std::string& line)>;

  // Starts argv[0] (a path) with `env` added to the launcher's environment; each output line
  // goes to `sink`. Returns false (and sets *error) when fork/exec fails.
  bool Start(const std::string& name, const std::vector<std::string>& argv,
             const std::map<std::string, std::string>& env, LineSink sink, std::string* error);
  ~ChildProcess();

  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }
  // Non-blocking: true once the child has exited; *status is its wait status.
  bool Exited(int* status);
  void Signal(int sig) const;
  // Waits up to `seconds` for the child to exit; true when it did.
  bool WaitFor(double seconds, int* status);
  // After the child exited: waits until all its output went to the sink.
  void DrainOutput();

 private:
  std::string name_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::thread reader_;
};

// "exited with code 3" / "killed by signal 9 (Killed)".
std::string DescribeStatus(int status);

}  // namespace tgis::launcher

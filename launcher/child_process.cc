#include "launcher/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace tgis::launcher {

bool ChildProcess::Start(const std::string& name, const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, LineSink sink,
                         std::string* error) {
  name_ = name;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    *error = std::string("pipe: ") + strerror(errno);
    return false;
  }
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) {
    *error = std::string("fork: ") + strerror(errno);
    return false;
  }
  if (pid_ == 0) {
    // Child: die with the launcher, even when it is SIGKILLed.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "cannot execute %s: %s\n", args[0], strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  const int fd = fds[0];
  reader_ = std::thread([fd, sink, name] {
    std::string buf;
    char chunk[4096];
    for (;;) {
      ssize_t n = read(fd, chunk, sizeof(chunk));
      if (n <= 0) break;
      buf.append(chunk, n);
      size_t nl;
      while ((nl = buf.find('\n')) != std::string::npos) {
        sink(name, buf.substr(0, nl));
        buf.erase(0, nl + 1);
      }
    }
    if (!buf.empty()) sink(name, buf);
    close(fd);
  });
  return true;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
  if (reader_.joinable()) reader_.join();
}

void ChildProcess::DrainOutput() {
  if (reader_.joinable()) reader_.join();
}

bool ChildProcess::Exited(int* status) {
  if (reaped_) {
    *status = status_;
    return true;
  }
  if (pid_ <= 0) return true;
  pid_t r = waitpid(pid_, &status_, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    *status = status_;
    return true;
  }
  return false;
}

void ChildProcess::Signal(int sig) const {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

bool ChildProcess::WaitFor(double seconds, int* status) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Exited(status)) return true;
    usleep(20 * 1000);
  }
  return Exited(status);
}

std::string DescribeStatus(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "ended (status " + std::to_string(status) + ")";
}

}  // namespace tgis::launcher

// Internal: the persistent CPU thread pool the kernels share (one per process, created on first
// use, sized to the TGIS_CPU_THREADS environment variable, else SetGlobalPoolSize's choice,
// else CpusAvailable()). Work is split so that results never depend on the number of threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

namespace tgis::kernels::cpu {

class ThreadPool {
 public:
  static ThreadPool& Global();

  // Threads that take part in a job, the calling thread included.
  int size() const { return size_; }

  // Runs fn(task) for every task in [0, num_tasks) and returns when all are done; the calling
  // thread takes part. A call made from inside a task, or while another thread's job is
  // running, runs its tasks inline on the calling thread.
  void Run(int64_t num_tasks, const std::function<void(int64_t)>& fn);

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  explicit ThreadPool(int size);
  struct State;
  State* state_;
  int size_;
};

// CPUs this process may run on: its affinity mask (taskset, a cpuset), capped by its cgroup's
// CPU quota (a container's limits.cpu) rounded up. std::thread::hardware_concurrency() counts
// every CPU of the host: a pod limited to 4 CPUs on a 64-core node would run 64 spinning
// workers and spend its quota being throttled.
int CpusAvailable();
// The CPUs of a cgroup quota written as cgroup v2's cpu.max ("QUOTA PERIOD", or "max PERIOD"
// for none), rounded up; 0 for no quota or a text that is not one.
int CpusOfCgroupMax(std::string_view text);
// The global pool's size, asked before its first use (false after: the pool exists);
// TGIS_CPU_THREADS, when set, still wins.
bool SetGlobalPoolSize(int n);

// Splits [0, n) into contiguous chunks of at least `grain` items (about 4 per thread) and runs
// fn(begin, end) on each in parallel.
void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tgis::kernels::cpu

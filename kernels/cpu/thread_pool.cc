#include "kernels/cpu/thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tgis::kernels::cpu {

namespace {
thread_local bool tls_in_job = false;
}  // namespace

// Waiting: a worker between jobs, and the caller for the workers' last tasks, first spin for up
// to kSpin and only then sleep on a condition variable. Decode runs hundreds of short jobs per
// token, one per op, and a futex sleep and wake costs tens of microseconds each on a VM, which
// is what a job itself takes (measured: TinyLlama 4-bit decode, 2 threads, EPYC Zen 5). Spins of
// 20, 100 and 400 us measured the same (the gaps between one op's job and the next are shorter),
// so it is short: idle workers sleep, and leave the core to the router, kSpin after a job.
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins until done() or kSpin has passed; returns done().
template <typename Done>
bool SpinUntil(const Done& done) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    if (std::chrono::steady_clock::now() >= until) return done();
  }
}

struct ThreadPool::State {
  std::mutex submit_mu;  // one job at a time
  std::mutex mu;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::atomic<uint64_t> generation{0};  // written under mu
  std::atomic<int> active{0};           // workers that have not finished the current job
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::vector<std::thread> workers;

  void RunTasks() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) (*fn)(i);
  }

  void WorkerLoop() {
    tls_in_job = true;
    uint64_t seen = 0;
    for (;;) {
      auto started = [&] { return generation.load(std::memory_order_acquire) != seen; };
      if (!SpinUntil(started)) {
        std::unique_lock<std::mutex> lk(mu);
        work_cv.wait(lk, started);
      }
      seen = generation.load(std::memory_order_acquire);
      RunTasks();
      if (active.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(mu);  // the caller may be between its check and its wait
        done_cv.notify_one();
      }
    }
  }
};

namespace {

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

// The process's cgroup v2 path ("0::/kubepods/..."), "" without one.
std::string CgroupV2Path() {
  std::ifstream in("/proc/self/cgroup");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("0::", 0) == 0) return line.substr(3);
  }
  return "";
}

// A cgroup's CPU quota, in CPUs rounded up; 0 for none (v2 first, then v1's CFS files).
int CgroupQuotaCpus() {
  const std::string path = CgroupV2Path();
  for (const std::string& file :
       {"/sys/fs/cgroup" + path + "/cpu.max", std::string("/sys/fs/cgroup/cpu.max")}) {
    if (const int n = CpusOfCgroupMax(ReadSmallFile(file)); n > 0) return n;
  }
  for (const char* dir : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}) {
    const std::string quota = ReadSmallFile(std::string(dir) + "/cpu.cfs_quota_us");
    const std::string period = ReadSmallFile(std::string(dir) + "/cpu.cfs_period_us");
    if (const int n = CpusOfCgroupMax(quota + " " + period); n > 0) return n;
  }
  return 0;
}

std::atomic<int> g_requested_size{0};  // SetGlobalPoolSize's, before the pool exists
std::atomic<bool> g_pool_made{false};

}  // namespace

int CpusOfCgroupMax(std::string_view text) {
  // "QUOTA PERIOD" in microseconds, or "max PERIOD" (v1: a quota of -1) for no limit.
  int64_t quota = 0, period = 0;
  const std::string s(text);
  char tail = 0;
  if (std::sscanf(s.c_str(), "%" SCNd64 " %" SCNd64 " %c", &quota, &period, &tail) != 2 ||
      quota <= 0 || period <= 0) {
    return 0;
  }
  return static_cast<int>(std::min<int64_t>((quota + period - 1) / period, 1 << 20));
}

int CpusAvailable() {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (const int quota = CgroupQuotaCpus(); quota > 0) n = std::min(n, quota);
  return std::max(1, n);
}

bool SetGlobalPoolSize(int n) {
  if (g_pool_made.load()) return false;
  g_requested_size.store(std::max(1, n));
  return true;
}

ThreadPool& ThreadPool::Global() {
  // Never destroyed: the workers simply stay blocked until the process exits.
  static ThreadPool* pool = [] {
    g_pool_made.store(true);
    int n = g_requested_size.load();
    if (n == 0) n = CpusAvailable();
    if (const char* env = std::getenv("TGIS_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) n = v;
    }
    return new ThreadPool(std::max(1, n));
  }();
  return *pool;
}

ThreadPool::ThreadPool(int size) : state_(new State), size_(size) {
  for (int i = 1; i < size; ++i) state_->workers.emplace_back([s = state_] { s->WorkerLoop(); });
}

void ThreadPool::Run(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  State& s = *state_;
  if (s.workers.empty() || num_tasks == 1 || tls_in_job || !s.submit_mu.try_lock()) {
    for (int64_t i = 0; i < num_tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.fn = &fn;
    s.num_tasks = num_tasks;
    s.next.store(0, std::memory_order_relaxed);
    s.active.store(static_cast<int>(s.workers.size()), std::memory_order_relaxed);
    s.generation.fetch_add(1, std::memory_order_release);
  }
  s.work_cv.notify_all();
  tls_in_job = true;
  s.RunTasks();
  tls_in_job = false;
  auto finished = [&] { return s.active.load(std::memory_order_acquire) == 0; };
  if (!SpinUntil(finished)) {
    std::unique_lock<std::mutex> lk(s.mu);
    s.done_cv.wait(lk, finished);
  }
  s.submit_mu.unlock();
}

void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  ThreadPool& pool = ThreadPool::Global();
  grain = std::max<int64_t>(1, grain);
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, 4 * int64_t{pool.size()});
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  const int64_t step = (n + chunks - 1) / chunks;
  chunks = (n + step - 1) / step;
  pool.Run(chunks, [&](int64_t c) { fn(c * step, std::min(n, (c + 1) * step)); });
}

}  // namespace tgis::kernels::cpu

#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace tgis::kernels::cpu {

namespace {
thread_local bool tls_in_job = false;
}  // namespace

struct ThreadPool::State {
  std::mutex submit_mu;  // one job at a time
  std::mutex mu;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  uint64_t generation = 0;
  int active = 0;  // workers that have not finished the current job
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
      {
        std::unique_lock<std::mutex> lk(mu);
        work_cv.wait(lk, [&] { return generation != seen; });
        seen = generation;
      }
      RunTasks();
      std::lock_guard<std::mutex> lk(mu);
      if (--active == 0) done_cv.notify_one();
    }
  }
};

ThreadPool& ThreadPool::Global() {
  // Never destroyed: the workers simply stay blocked until the process exits.
  static ThreadPool* pool = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
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
    s.active = static_cast<int>(s.workers.size());
    ++s.generation;
  }
  s.work_cv.notify_all();
  tls_in_job = true;
  s.RunTasks();
  tls_in_job = false;
  {
    std::unique_lock<std::mutex> lk(s.mu);
    s.done_cv.wait(lk, [&] { return s.active == 0; });
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

// GET /health as TGIS answers it: 200 only while every shard answers Health and a real
// generation has succeeded since start or since the last failure. Any successful Prefill or
// Decode counts as that generation; after a failure (or before any traffic), a probe runs a
// one-token health-check generation through the batcher and answers 200 only once it
// succeeds. While generation is healthy a probe only asks the shards for Health, and not even
// that when a success is more recent than `fresh_for` (probes stay cheap under load).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>

namespace tgis::router {

struct HealthOptions {
  // A success (traffic or probe) this recent answers a probe without any call to the shards.
  std::chrono::milliseconds fresh_for{3000};
  // The longest a probe waits for a health-check generation; one that takes longer goes on,
  // and its result serves the next probe.
  std::chrono::milliseconds generation_wait{10000};
};

class HealthMonitor {
 public:
  using Clock = std::chrono::steady_clock;

  // Health on every shard: true when all of them answered.
  using ShardHealth = std::function<bool()>;
  // Queues a one-token health-check generation; `done(ok)` is called once when it ends, from
  // any thread (possibly before StartGeneration returns).
  using StartGeneration = std::function<void(std::function<void(bool)> done)>;

  explicit HealthMonitor(HealthOptions options = HealthOptions(),
                         std::function<Clock::time_point()> now = Clock::now);

  // The shards are ready and the batcher runs: probes may succeed from now on. The callables
  // must stay valid until Detach().
  void Attach(ShardHealth shard_health, StartGeneration start_generation);
  // Before shutdown (draining): every probe answers false from now on. Returns once no probe
  // uses the callables any more.
  void Detach();

  // From the batcher, after every Prefill and Decode: whether it succeeded.
  void OnGenerationResult(bool ok);

  // The probe: true for 200, false for 503. Thread-safe; concurrent probes share one
  // health-check generation.
  bool Check();

 private:
  void OnHealthGenerationDone(bool ok);

  const HealthOptions options_;
  const std::function<Clock::time_point()> now_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool attached_ = false;
  ShardHealth shard_health_;
  StartGeneration start_generation_;
  bool generation_healthy_ = false;  // a generation succeeded since start / the last failure
  std::optional<Clock::time_point> last_ok_;
  bool generation_in_flight_ = false;
  int callables_in_use_ = 0;  // probes calling shard_health_ / start_generation_ unlocked
};

}  // namespace tgis::router

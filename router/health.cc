#include "router/health.h"

#include <glog/logging.h>

namespace tgis::router {

HealthMonitor::HealthMonitor(HealthOptions options, std::function<Clock::time_point()> now)
    : options_(options), now_(std::move(now)) {}

void HealthMonitor::Attach(ShardHealth shard_health, StartGeneration start_generation) {
  std::lock_guard<std::mutex> lock(mu_);
  shard_health_ = std::move(shard_health);
  start_generation_ = std::move(start_generation);
  attached_ = true;
}

void HealthMonitor::Detach() {
  std::unique_lock<std::mutex> lock(mu_);
  attached_ = false;
  cv_.notify_all();
  cv_.wait(lock, [this] { return callables_in_use_ == 0; });
}

void HealthMonitor::OnGenerationResult(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ok != generation_healthy_) {
      if (ok) {
        LOG(INFO) << "health: generation succeeded";
      } else {
        LOG(WARNING) << "health: generation failed; /health answers 503 until one succeeds";
      }
    }
    generation_healthy_ = ok;
    if (ok) last_ok_ = now_();
  }
  cv_.notify_all();
}

void HealthMonitor::OnHealthGenerationDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_in_flight_ = false;
    if (ok) {
      generation_healthy_ = true;
      last_ok_ = now_();
    } else {
      LOG(WARNING) << "health: the health-check generation failed";
    }
  }
  cv_.notify_all();
}

bool HealthMonitor::Check() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!attached_) return false;
  if (generation_healthy_) {
    if (last_ok_.has_value() && now_() - *last_ok_ < options_.fresh_for) return true;
    // Generation works: only ask the shards whether they answer.
    ++callables_in_use_;
    lock.unlock();
    const bool ok = shard_health_();
    lock.lock();
    if (--callables_in_use_ == 0) cv_.notify_all();
    if (ok) {
      last_ok_ = now_();
      return attached_;
    }
    // A shard that does not answer is a failure: a generation has to succeed again.
    if (generation_healthy_) LOG(WARNING) << "health: a shard does not answer Health";
    generation_healthy_ = false;
    return false;
  }
  // No generation succeeded since start or the last failure: run one (one for all probes).
  if (!generation_in_flight_) {
    generation_in_flight_ = true;
    ++callables_in_use_;
    lock.unlock();
    start_generation_([this](bool ok) { OnHealthGenerationDone(ok); });
    lock.lock();
    if (--callables_in_use_ == 0) cv_.notify_all();
  }
  cv_.wait_for(lock, options_.generation_wait,
               [this] { return generation_healthy_ || !generation_in_flight_ || !attached_; });
  return attached_ && generation_healthy_;
}

}  // namespace tgis::router

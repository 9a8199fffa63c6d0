#include "server/step_ahead.h"

#include <algorithm>
#include <utility>

namespace tgis::server {

StepAhead::StepAhead(std::mutex* mu, Engine* engine)
    : mu_(mu), engine_(engine), worker_([this] { WorkerLoop(); }) {}

StepAhead::~StepAhead() {
  {
    std::lock_guard<std::mutex> lock(*mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void StepAhead::Schedule(const std::vector<uint64_t>& ids) {
  std::vector<uint64_t> fresh;
  for (uint64_t id : ids) {
    if (!Pending(id)) fresh.push_back(id);
  }
  scheduled_ = engine_->DecodableAhead(fresh);
  if (!scheduled_.empty()) cv_.notify_one();
}

void StepAhead::RunScheduled() {
  if (!scheduled_.empty()) Run();
}

void StepAhead::Run() {
  const std::vector<uint64_t> ids = std::move(scheduled_);
  scheduled_.clear();
  std::vector<StepOutput> outs;
  std::vector<SequenceError> errors;
  // No `preempted`: DecodableAhead left room for every one.
  engine_->Decode(ids, &outs, &errors);
  forward_ns_ += engine_->last_forward_ns();
  for (StepOutput& o : outs) outs_[o.id] = std::move(o);
  for (SequenceError& e : errors) errors_.emplace(e.id, std::move(e));
}

bool StepAhead::Take(uint64_t id, std::vector<StepOutput>* out,
                     std::vector<SequenceError>* errors) {
  if (auto it = outs_.find(id); it != outs_.end()) {
    out->push_back(std::move(it->second));
    outs_.erase(it);
    return true;
  }
  if (auto it = errors_.find(id); it != errors_.end()) {
    errors->push_back(std::move(it->second));
    errors_.erase(it);
    return true;
  }
  return false;
}

void StepAhead::Drop(uint64_t id) {
  outs_.erase(id);
  errors_.erase(id);
}

void StepAhead::DropAll() {
  outs_.clear();
  errors_.clear();
}

uint64_t StepAhead::TakeForwardNs() { return std::exchange(forward_ns_, 0); }

void StepAhead::WorkerLoop() {
  std::unique_lock<std::mutex> lock(*mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !scheduled_.empty(); });
    if (stop_) return;
    Run();
  }
}

}  // namespace tgis::server

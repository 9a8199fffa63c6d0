#include "router/queue.h"

#include <algorithm>

namespace tgis::router {

Footprint FootprintOf(const GenerationRequest& request, uint32_t generated, uint32_t lookahead) {
  // The step that produces token g + 1 writes the prompt and the g tokens before it to the
  // cache; the shard may count one more slot for the token being produced.
  const uint32_t max_new = request.params.max_new_tokens;
  uint32_t steps = max_new > generated ? max_new - generated : 0;
  if (lookahead > 0) steps = std::min(steps, lookahead);
  return Footprint{.tokens = request.prompt_length() + generated + 1, .steps = steps};
}

uint64_t FinalTokens(std::span<const Footprint> requests, uint32_t block_size) {
  const uint64_t bs = std::max<uint32_t>(block_size, 1);
  uint64_t total = 0;
  for (const Footprint& r : requests) {
    if (r.steps > 0) total += (r.tokens + r.steps - 1 + bs - 1) / bs * bs;
  }
  return total;
}

uint64_t PeakTokens(std::span<const Footprint> requests, uint32_t block_size) {
  const uint64_t bs = std::max<uint32_t>(block_size, 1);
  auto blocks = [bs](uint64_t tokens) { return (tokens + bs - 1) / bs * bs; };
  // Each request's share only grows while it runs, so the total peaks just before some request
  // finishes: at step s = steps - 1 of one of them. O(n^2) for a batch of n, which is small.
  uint64_t peak = 0;
  for (const Footprint& at : requests) {
    if (at.steps == 0) continue;
    const uint64_t s = at.steps - 1;
    uint64_t total = 0;
    for (const Footprint& r : requests) {
      if (r.steps > s) total += blocks(r.tokens + s);
    }
    peak = std::max(peak, total);
  }
  return peak;
}

double PrefillPadding(std::span<const uint32_t> input_lengths, bool padded_batches) {
  if (!padded_batches || input_lengths.empty()) return 0.0;
  uint64_t total = 0;
  uint32_t longest = 0;
  for (uint32_t n : input_lengths) {
    total += n;
    longest = std::max(longest, n);
  }
  const double padded = static_cast<double>(longest) * static_cast<double>(input_lengths.size());
  return padded > 0 ? 1.0 - static_cast<double>(total) / padded : 0.0;
}

void RequestQueue::Push(std::unique_ptr<GenerationRequest> request) {
  queue_.push_back(std::move(request));
}

void RequestQueue::PushFront(std::unique_ptr<GenerationRequest> request) {
  queue_.push_front(std::move(request));
}

std::unique_ptr<GenerationRequest> RequestQueue::PopFront() {
  if (queue_.empty()) return nullptr;
  std::unique_ptr<GenerationRequest> r = std::move(queue_.front());
  queue_.pop_front();
  return r;
}

std::vector<std::unique_ptr<GenerationRequest>> RequestQueue::TakeAll() {
  std::vector<std::unique_ptr<GenerationRequest>> all;
  for (auto& r : queue_) all.push_back(std::move(r));
  queue_.clear();
  return all;
}

RequestQueue::Removed RequestQueue::RemoveCancelledAndExpired(Clock::time_point now) {
  Removed removed;
  std::deque<std::unique_ptr<GenerationRequest>> kept;
  for (auto& r : queue_) {
    if (r->sink->Cancelled()) {
      removed.cancelled.push_back(std::move(r));
    } else if (r->params.deadline.has_value() && now > *r->params.deadline) {
      removed.expired.push_back(std::move(r));
    } else {
      kept.push_back(std::move(r));
    }
  }
  queue_ = std::move(kept);
  return removed;
}

std::optional<Clock::time_point> RequestQueue::EarliestDeadline() const {
  std::optional<Clock::time_point> earliest;
  for (const auto& r : queue_) {
    if (r->params.deadline.has_value() && (!earliest || *r->params.deadline < *earliest)) {
      earliest = r->params.deadline;
    }
  }
  return earliest;
}

std::vector<std::unique_ptr<GenerationRequest>> RequestQueue::NextBatch(
    std::span<const Footprint> running, size_t min_size, const AdmissionLimits& limits,
    AdmissionStats* stats) {
  AdmissionStats local;
  std::vector<std::unique_ptr<GenerationRequest>> batch;
  min_size = std::max<size_t>(min_size, 1);
  if (queue_.size() < min_size || running.size() + min_size > limits.max_batch_size) {
    return batch;
  }
  // TGIS's effective prefill weight limit: the free share of the KV cache, of the full limit.
  uint64_t prefill_limit = limits.max_prefill_tokens;
  if (prefill_limit > 0 && !running.empty() && limits.max_batch_tokens > 0) {
    uint64_t running_tokens = 0;
    for (const Footprint& f : running) running_tokens += f.tokens;
    const double free_share =
        1.0 - static_cast<double>(running_tokens) / static_cast<double>(limits.max_batch_tokens);
    prefill_limit = static_cast<uint64_t>(std::max(0.0, free_share) *
                                          static_cast<double>(limits.max_prefill_tokens));
    if (prefill_limit == 0) return batch;
  }
  std::vector<Footprint> footprints(running.begin(), running.end());
  std::vector<size_t> chosen;
  std::vector<uint32_t> prefill_lengths;
  uint64_t prefill_tokens = 0;
  std::optional<Clock::time_point> cutoff;
  for (size_t i = 0; i < queue_.size(); ++i) {
    const GenerationRequest& r = *queue_[i];
    if (cutoff.has_value() && r.queued > *cutoff) break;
    footprints.push_back(FootprintOf(r, 0, limits.lookahead_steps));
    if (PeakTokens(footprints, limits.block_size) > limits.max_batch_tokens) {
      footprints.pop_back();
      if (!cutoff.has_value()) cutoff = r.queued + kOvertakeWindow;
      continue;
    }
    // Then the prefill's own limits, as TGIS checks them: weight first, then padding.
    prefill_lengths.push_back(r.prompt_length());
    bool skip = false;
    if (prefill_limit > 0 && prefill_tokens + r.prompt_length() > prefill_limit) {
      ++local.prefill_weight_exceeded;
      skip = true;
    } else if (PrefillPadding(prefill_lengths, limits.padded_batches) >
               limits.max_prefill_padding) {
      ++local.prefill_padding_exceeded;
      skip = true;
    }
    if (skip) {
      footprints.pop_back();
      prefill_lengths.pop_back();
      if (!cutoff.has_value()) cutoff = r.queued + kOvertakeWindow;
      continue;
    }
    prefill_tokens += r.prompt_length();
    if (cutoff.has_value()) ++local.queue_jumps;
    if (FinalTokens(footprints, limits.block_size) > limits.max_batch_tokens) {
      ++local.granular_additions;
    }
    chosen.push_back(i);
    if (running.size() + chosen.size() >= limits.max_batch_size) break;
  }
  // The limits' counters count also when nothing is taken: TGIS counts every skip.
  if (stats != nullptr) {
    stats->prefill_weight_exceeded = local.prefill_weight_exceeded;
    stats->prefill_padding_exceeded = local.prefill_padding_exceeded;
  }
  if (chosen.size() < min_size) return batch;
  if (stats != nullptr) *stats = local;
  for (size_t i : chosen) batch.push_back(std::move(queue_[i]));
  std::erase_if(queue_, [](const auto& r) { return r == nullptr; });
  return batch;
}

}  // namespace tgis::router

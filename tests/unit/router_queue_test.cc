// The waiting queue and KV-cache admission (router/queue.h).
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "router/queue.h"

namespace tgis::router {
namespace {

class FlagSink : public ResponseSink {
 public:
  void Send(fmaas::GenerationResponse) override {}
  void Finish(absl::StatusOr<fmaas::GenerationResponse>) override {}
  bool Cancelled() const override { return cancelled; }
  std::atomic<bool> cancelled{false};
};

std::unique_ptr<GenerationRequest> Request(uint64_t id, uint32_t input, uint32_t max_new,
                                           Clock::time_point queued = Clock::now()) {
  auto r = std::make_unique<GenerationRequest>();
  r->id = id;
  r->input_ids.assign(input, 5);
  r->params.max_new_tokens = max_new;
  r->sink = std::make_shared<FlagSink>();
  r->queued = queued;
  return r;
}

std::vector<uint64_t> Ids(const std::vector<std::unique_ptr<GenerationRequest>>& batch) {
  std::vector<uint64_t> ids;
  for (const auto& r : batch) ids.push_back(r->id);
  return ids;
}

TEST(RouterQueue, FootprintCountsTheNextStep) {
  auto r = Request(1, 10, 5);
  Footprint f = FootprintOf(*r, 0);
  EXPECT_EQ(f.tokens, 11u);
  EXPECT_EQ(f.steps, 5u);
  f = FootprintOf(*r, 3);
  EXPECT_EQ(f.tokens, 14u);
  EXPECT_EQ(f.steps, 2u);
}

TEST(RouterQueue, PeakTokens) {
  // One request: its last step holds input + max_new tokens.
  std::vector<Footprint> one{FootprintOf(*Request(1, 10, 5), 0)};
  EXPECT_EQ(PeakTokens(one, 1), 15u);
  EXPECT_EQ(PeakTokens(one, 4), 16u);  // whole blocks
  // A short request finishes before a long one peaks: the peak is below the sum of finals.
  std::vector<Footprint> two{{.tokens = 101, .steps = 2}, {.tokens = 11, .steps = 100}};
  // At s = 1 both run: 102 + 12; at s = 99 only the second: 110.
  EXPECT_EQ(PeakTokens(two, 1), 114u);
  two[0].steps = 50;
  EXPECT_EQ(PeakTokens(two, 1), 101 + 49 + 11 + 49u);
  EXPECT_EQ(PeakTokens({}, 16), 0u);
}

TEST(RouterQueue, TakesInOrderWithinBatchSize) {
  RequestQueue q;
  for (uint64_t i = 1; i <= 5; ++i) q.Push(Request(i, 4, 4));
  AdmissionLimits limits{.max_batch_size = 3, .max_batch_tokens = 1000, .block_size = 1};
  EXPECT_EQ(Ids(q.NextBatch({}, 1, limits)), (std::vector<uint64_t>{1, 2, 3}));
  // Two running leave room for one.
  std::vector<Footprint> running{{5, 3}, {5, 3}};
  EXPECT_EQ(Ids(q.NextBatch(running, 1, limits)), (std::vector<uint64_t>{4}));
  EXPECT_EQ(q.size(), 1u);
  // Not enough room for min_size.
  running.push_back({5, 3});
  EXPECT_TRUE(q.NextBatch(running, 1, limits).empty());
}

TEST(RouterQueue, RespectsTheKvBudget) {
  RequestQueue q;
  q.Push(Request(1, 40, 10));  // 50 tokens at its end
  q.Push(Request(2, 40, 10));
  q.Push(Request(3, 10, 10));  // 20
  AdmissionLimits limits{.max_batch_size = 10, .max_batch_tokens = 120, .block_size = 1};
  EXPECT_EQ(Ids(q.NextBatch({}, 1, limits)), (std::vector<uint64_t>{1, 2, 3}));

  q.Push(Request(4, 40, 10));
  std::vector<Footprint> running{{.tokens = 71, .steps = 20}};  // 90 at its end
  EXPECT_TRUE(q.NextBatch(running, 1, limits).empty());
  running[0].steps = 2;  // finishes soon: 4 fits after it
  EXPECT_EQ(Ids(q.NextBatch(running, 1, limits)), (std::vector<uint64_t>{4}));
}

TEST(RouterQueue, SmallRequestsOvertakeOnlyWithinTheWindow) {
  const Clock::time_point t0 = Clock::now();
  RequestQueue q;
  q.Push(Request(1, 90, 10, t0));  // does not fit next to the running request
  q.Push(Request(2, 5, 5, t0 + std::chrono::milliseconds(10)));
  q.Push(Request(3, 5, 5, t0 + RequestQueue::kOvertakeWindow + std::chrono::milliseconds(1)));
  AdmissionLimits limits{.max_batch_size = 10, .max_batch_tokens = 100, .block_size = 1};
  std::vector<Footprint> running{{.tokens = 20, .steps = 50}};
  EXPECT_EQ(Ids(q.NextBatch(running, 1, limits)), (std::vector<uint64_t>{2}));
  // Request 3 arrived too long after request 1 to pass it.
  EXPECT_TRUE(q.NextBatch(running, 1, limits).empty());
  EXPECT_EQ(Ids(q.NextBatch({}, 1, limits)), (std::vector<uint64_t>{1}));
  EXPECT_EQ(Ids(q.NextBatch({}, 1, limits)), (std::vector<uint64_t>{3}));
}

TEST(RouterQueue, MinSize) {
  RequestQueue q;
  q.Push(Request(1, 4, 4));
  q.Push(Request(2, 4, 4));
  AdmissionLimits limits{.max_batch_size = 10, .max_batch_tokens = 1000, .block_size = 1};
  EXPECT_TRUE(q.NextBatch({}, 3, limits).empty());
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(Ids(q.NextBatch({}, 2, limits)), (std::vector<uint64_t>{1, 2}));
}

TEST(RouterQueue, RemovesCancelledAndExpired) {
  const Clock::time_point now = Clock::now();
  RequestQueue q;
  q.Push(Request(1, 4, 4));
  auto cancelled = Request(2, 4, 4);
  static_cast<FlagSink*>(cancelled->sink.get())->cancelled = true;
  q.Push(std::move(cancelled));
  auto expired = Request(3, 4, 4);
  expired->params.deadline = now - std::chrono::milliseconds(1);
  q.Push(std::move(expired));
  auto later = Request(4, 4, 4);
  later->params.deadline = now + std::chrono::seconds(5);
  q.Push(std::move(later));

  EXPECT_EQ(q.EarliestDeadline(), now - std::chrono::milliseconds(1));
  RequestQueue::Removed removed = q.RemoveCancelledAndExpired(now);
  EXPECT_EQ(Ids(removed.cancelled), (std::vector<uint64_t>{2}));
  EXPECT_EQ(Ids(removed.expired), (std::vector<uint64_t>{3}));
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(q.EarliestDeadline(), now + std::chrono::seconds(5));
  EXPECT_EQ(Ids(q.TakeAll()), (std::vector<uint64_t>{1, 4}));
  EXPECT_TRUE(q.empty());
}

TEST(RouterQueue, AdmissionStats) {
  // Request 1 does not fit next to the running one; 2 jumps the queue past it.
  const Clock::time_point t0 = Clock::now();
  RequestQueue q;
  q.Push(Request(1, 90, 10, t0));
  q.Push(Request(2, 5, 5, t0 + std::chrono::milliseconds(10)));
  AdmissionLimits limits{.max_batch_size = 10, .max_batch_tokens = 100, .block_size = 1};
  std::vector<Footprint> running{{.tokens = 20, .steps = 50}};
  AdmissionStats stats;
  EXPECT_EQ(Ids(q.NextBatch(running, 1, limits, &stats)), (std::vector<uint64_t>{2}));
  EXPECT_EQ(stats.queue_jumps, 1u);
  EXPECT_EQ(stats.granular_additions, 0u);  // 69 + 10 tokens fit even at their ends

  // A short long-prompt request and a long short-prompt one: their final lengths add up to
  // more than the cache, but the first is done before the second grows: granular admission.
  RequestQueue q2;
  q2.Push(Request(3, 10, 100));  // peaks at 110
  AdmissionLimits tight{.max_batch_size = 10, .max_batch_tokens = 150, .block_size = 1};
  std::vector<Footprint> finishing{{.tokens = 100, .steps = 2}};  // 101 at its end
  stats = {};
  EXPECT_EQ(Ids(q2.NextBatch(finishing, 1, tight, &stats)), (std::vector<uint64_t>{3}));
  EXPECT_EQ(stats.queue_jumps, 0u);
  EXPECT_EQ(stats.granular_additions, 1u);
  EXPECT_EQ(FinalTokens(finishing, 1), 101u);
}

// TGIS's prefill weight limit (queue.rs next_batch): a request whose prompt would take the
// prefill over the limit is skipped and counted; later, smaller ones may still join.
TEST(RouterQueue, PrefillWeightLimitSkipsAndCounts) {
  RequestQueue q;
  q.Push(Request(1, 60, 1));
  q.Push(Request(2, 60, 1));
  q.Push(Request(3, 30, 1));
  AdmissionLimits limits{
      .max_batch_size = 8, .max_batch_tokens = 1000, .block_size = 1, .max_prefill_tokens = 100};
  AdmissionStats stats;
  auto batch = q.NextBatch({}, 1, limits, &stats);
  EXPECT_EQ(Ids(batch), (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(stats.prefill_weight_exceeded, 1u);
  EXPECT_EQ(stats.prefill_padding_exceeded, 0u);
  // Without the limit (today's default for shards that report none) all three go.
  RequestQueue all;
  for (uint64_t id : {1, 2, 3}) all.Push(Request(id, 60, 1));
  limits.max_prefill_tokens = 0;
  EXPECT_EQ(all.NextBatch({}, 1, limits).size(), 3u);
}

// The limit shrinks with the share of the KV cache the running batch holds, as in TGIS.
TEST(RouterQueue, PrefillWeightLimitShrinksWithTheRunningBatch) {
  RequestQueue q;
  q.Push(Request(1, 60, 1));
  AdmissionLimits limits{
      .max_batch_size = 8, .max_batch_tokens = 1000, .block_size = 1, .max_prefill_tokens = 100};
  // Running requests hold 500 of 1000 tokens: the limit is 50, under the 60-token prompt.
  std::vector<Footprint> running{{.tokens = 500, .steps = 1}};
  AdmissionStats stats;
  EXPECT_TRUE(q.NextBatch(running, 1, limits, &stats).empty());
  EXPECT_EQ(stats.prefill_weight_exceeded, 1u);
  running[0].tokens = 300;  // limit 70
  EXPECT_EQ(q.NextBatch(running, 1, limits).size(), 1u);
}

// MAX_PREFILL_PADDING applies to shards that pad prompts to the longest; ragged batches have
// none, so the same requests go together there.
TEST(RouterQueue, PrefillPaddingLimit) {
  EXPECT_DOUBLE_EQ(PrefillPadding(std::vector<uint32_t>{10, 30}, true), 1.0 - 40.0 / 60.0);
  EXPECT_DOUBLE_EQ(PrefillPadding(std::vector<uint32_t>{10, 30}, false), 0.0);
  AdmissionLimits limits{.max_batch_size = 8,
                         .max_batch_tokens = 1000,
                         .block_size = 1,
                         .max_prefill_padding = 0.2,
                         .padded_batches = true};
  RequestQueue q;
  q.Push(Request(1, 100, 1));
  q.Push(Request(2, 10, 1));  // 100 + 10 padded to 200: 45% padding
  q.Push(Request(3, 90, 1));  // 100 + 90 padded to 200: 5%
  AdmissionStats stats;
  EXPECT_EQ(Ids(q.NextBatch({}, 1, limits, &stats)), (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(stats.prefill_padding_exceeded, 1u);
  EXPECT_EQ(stats.prefill_weight_exceeded, 0u);
  RequestQueue ragged;
  for (uint64_t id : {1, 2, 3}) ragged.Push(Request(id, id == 2 ? 10 : 100, 1));
  limits.padded_batches = false;
  EXPECT_EQ(ragged.NextBatch({}, 1, limits).size(), 3u);
}

}  // namespace
}  // namespace tgis::router

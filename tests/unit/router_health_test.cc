// GET /health's state machine (router/health.h): 200 only after a generation succeeded since
// start or the last failure; a health-check generation when there was none; cached successes.
#include <gtest/gtest.h>

#include <thread>

#include "router/health.h"

namespace tgis::router {
namespace {

using namespace std::chrono_literals;

class HealthTest : public ::testing::Test {
 protected:
  HealthTest()
      : monitor_(HealthOptions{.fresh_for = 3s, .generation_wait = 50ms}, [this] { return now_; }) {
  }

  // Attaches fakes: the shards answer `shards_ok_`; a health-check generation ends at once
  // with `generation_ok_`, or, when `hold_generation_`, waits for Finish().
  void Attach() {
    monitor_.Attach(
        [this] {
          ++shard_checks_;
          return shards_ok_;
        },
        [this](std::function<void(bool)> done) {
          ++generations_;
          if (hold_generation_) {
            pending_ = std::move(done);
          } else {
            done(generation_ok_);
          }
        });
  }

  HealthMonitor::Clock::time_point now_ = HealthMonitor::Clock::time_point{} + 1h;
  HealthMonitor monitor_;
  bool shards_ok_ = true;
  bool generation_ok_ = true;
  bool hold_generation_ = false;
  std::function<void(bool)> pending_;
  int shard_checks_ = 0;
  int generations_ = 0;
};

TEST_F(HealthTest, UnavailableUntilAttached) {
  EXPECT_FALSE(monitor_.Check());
  monitor_.OnGenerationResult(true);  // even traffic does not make it ready before Attach
  EXPECT_FALSE(monitor_.Check());
  EXPECT_EQ(generations_, 0);
}

TEST_F(HealthTest, FirstProbeRunsAGeneration) {
  Attach();
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 1);
  // Fresh: neither a generation nor a shard Health call.
  now_ += 1s;
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 1);
  EXPECT_EQ(shard_checks_, 0);
  // Stale: the shards are asked, no generation.
  now_ += 5s;
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 1);
  EXPECT_EQ(shard_checks_, 1);
  // That success is fresh again.
  now_ += 1s;
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(shard_checks_, 1);
}

TEST_F(HealthTest, TrafficCountsAsTheGeneration) {
  Attach();
  monitor_.OnGenerationResult(true);
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 0);
  EXPECT_EQ(shard_checks_, 0);
}

TEST_F(HealthTest, FailedGenerationNeedsANewOne) {
  Attach();
  monitor_.OnGenerationResult(true);
  monitor_.OnGenerationResult(false);  // a Prefill or Decode failed
  generation_ok_ = false;
  EXPECT_FALSE(monitor_.Check());
  EXPECT_EQ(generations_, 1);
  EXPECT_FALSE(monitor_.Check());  // each probe retries
  EXPECT_EQ(generations_, 2);
  generation_ok_ = true;
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 3);
  EXPECT_TRUE(monitor_.Check());
  EXPECT_EQ(generations_, 3);
}

TEST_F(HealthTest, ShardWithoutHealthIsAFailure) {
  Attach();
  monitor_.OnGenerationResult(true);
  now_ += 10s;
  shards_ok_ = false;
  EXPECT_FALSE(monitor_.Check());
  EXPECT_EQ(shard_checks_, 1);
  // The shard is back, but a generation has to succeed before 200 again.
  shards_ok_ = true;
  generation_ok_ = false;
  EXPECT_FALSE(monitor_.Check());
  EXPECT_EQ(generations_, 1);
  generation_ok_ = true;
  EXPECT_TRUE(monitor_.Check());
}

TEST_F(HealthTest, SlowGenerationIsSharedAndServesALaterProbe) {
  hold_generation_ = true;
  Attach();
  EXPECT_FALSE(monitor_.Check());  // waited generation_wait, still running
  EXPECT_FALSE(monitor_.Check());  // no second generation while one runs
  EXPECT_EQ(generations_, 1);
  ASSERT_TRUE(pending_);
  // A probe waiting when it ends gets its result.
  std::thread finisher([this] {
    std::this_thread::sleep_for(10ms);
    pending_(true);
  });
  // Probes keep waiting (50 ms each) until the generation ends; however late a loaded
  // machine runs the finisher, one of them sees it.
  bool ok = false;
  for (int i = 0; i < 200 && !ok; ++i) ok = monitor_.Check();
  EXPECT_TRUE(ok);
  finisher.join();
  EXPECT_EQ(generations_, 1);
  EXPECT_TRUE(monitor_.Check());
}

TEST_F(HealthTest, DetachAnswersUnavailable) {
  Attach();
  EXPECT_TRUE(monitor_.Check());
  monitor_.Detach();
  EXPECT_FALSE(monitor_.Check());
}

}  // namespace
}  // namespace tgis::router

// Decode steps run ahead of the router: after the shard answers a step, it starts the next one
// for the sequences that will certainly still be decoding, while the answer crosses to the
// router and the router handles it. When the router's next Decode comes, those tokens are ready.
//
// Why: at batch 1 the step's round trip (gRPC, the router's detokenizing and stop checks) is
// time the accelerator sits idle, about 0.6 ms of a 7.5 ms token on the H100 (session 33) and
// most of a small model's token on the CPU.
//
// Why no step ever has to be undone: a sequence is stepped ahead only when the router cannot
// have finished it (it has tokens left to generate, its last token is not an end-of-sequence
// token, it is not prefilling or speculating), and only when the KV cache has room without
// preempting anyone. What the router can still do to it (a stop sequence, a time limit, a
// cancelled client) releases it, and a released sequence's extra token is simply dropped. The
// others' tokens do not depend on which sequences share their step: decode rows are batch
// invariant on every backend (LinearDecodeRowsAreBatchInvariant*).
//
// Tensor-parallel shards step together: the step scheduled after an answer runs on the worker
// thread or, if the next call arrives first, at that call's start (RunScheduled), so every
// shard runs the same steps in the same order whatever the threads' timing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "server/engine.h"

namespace tgis::server {

class StepAhead {
 public:
  // `mu` is the lock every call on `engine` holds; the worker holds it while it steps.
  StepAhead(std::mutex* mu, Engine* engine);
  ~StepAhead();
  StepAhead(const StepAhead&) = delete;
  StepAhead& operator=(const StepAhead&) = delete;

  // Under mu: schedules a step for those of `ids` that the engine can step ahead
  // (Engine::DecodableAhead) and that have no step waiting already.
  void Schedule(const std::vector<uint64_t>& ids);
  // Under mu: runs the scheduled step now, if the worker has not started it.
  void RunScheduled();
  // Under mu: moves id's stepped-ahead token (or error) to `out` / `errors`; false if it has
  // none.
  bool Take(uint64_t id, std::vector<StepOutput>* out, std::vector<SequenceError>* errors);
  // Under mu: whether id has a result waiting.
  bool Pending(uint64_t id) const { return outs_.count(id) > 0 || errors_.count(id) > 0; }
  // Under mu: forgets id's result (the sequence is being released).
  void Drop(uint64_t id);
  void DropAll();
  // Under mu: the forward time of the steps whose results were taken since the last call.
  uint64_t TakeForwardNs();

 private:
  void Run();
  void WorkerLoop();

  std::mutex* mu_;
  Engine* engine_;
  std::condition_variable cv_;  // waits on *mu_
  std::vector<uint64_t> scheduled_;
  bool stop_ = false;
  std::map<uint64_t, StepOutput> outs_;
  std::map<uint64_t, SequenceError> errors_;
  uint64_t forward_ns_ = 0;  // of steps run, not yet reported
  std::thread worker_;
};

}  // namespace tgis::server

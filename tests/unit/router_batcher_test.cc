// The batcher and the per-request output logic against a scripted fake shard: stopping
// criteria, stop sequences, streaming vs unary, cancellation, per-request errors, admission.
#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "metrics/registry.h"
#include "metrics/tgi_metrics.h"
#include "router/batcher.h"

namespace tgis::router {
namespace {

namespace pb = generate::v1;
using namespace std::chrono_literals;

// A shard whose requests generate scripted tokens, recording what the router asks of it.
class FakeShard final : public ShardClient {
 public:
  std::map<uint64_t, std::vector<int32_t>> scripts;  // request id -> its tokens
  int32_t filler = 0;                                // after a script runs out
  std::set<uint64_t> refuse;                         // fail these at prefill
  std::chrono::milliseconds step_delay{0};
  std::atomic<bool> unavailable{false};  // every Prefill and Decode fails as a dead shard would
  // Preemption: these are preempted at the next Decode that holds them; while `hold` is set, a
  // resume is answered "still preempted".
  std::set<uint64_t> preempt_next;
  std::atomic<bool> hold{false};

  absl::StatusOr<pb::InfoResponse> Info() override { return pb::InfoResponse(); }
  absl::Status Health() override { return absl::OkStatus(); }
  absl::StatusOr<pb::WarmupResponse> Warmup(const pb::WarmupRequest&) override {
    return pb::WarmupResponse();
  }

  absl::StatusOr<pb::PrefillResponse> Prefill(const pb::PrefillRequest& request) override {
    std::this_thread::sleep_for(step_delay);
    if (unavailable) return absl::UnavailableError("connection refused");
    std::lock_guard<std::mutex> lock(mu);
    pb::PrefillResponse response;
    std::vector<uint64_t> ids, live;
    for (const pb::Request& r : request.batch().requests()) {
      ids.push_back(r.id());
      if (r.resume()) {
        EXPECT_TRUE(preempted.count(r.id())) << "resumed " << r.id() << ", not preempted";
        if (hold) {
          response.add_preempted_request_ids(r.id());
          continue;
        }
        preempted.erase(r.id());
        resumed.push_back(r.id());
        live.push_back(r.id());
        Generate(r.id(), &response);
        continue;
      }
      requests[r.id()] = r;
      if (refuse.count(r.id())) {
        pb::RequestError* e = response.add_errors();
        e->set_request_id(r.id());
        e->set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
        e->set_message("bad request");
        continue;
      }
      live.push_back(r.id());
      Generate(r.id(), &response);
    }
    prefills.push_back(ids);
    if (!live.empty()) {
      batches[request.batch().id()] = live;
      *response.mutable_batch() = Describe(request.batch().id());
    }
    return response;
  }

  absl::StatusOr<pb::DecodeResponse> Decode(const pb::DecodeRequest& request) override {
    std::this_thread::sleep_for(step_delay);
    if (unavailable) return absl::UnavailableError("connection refused");
    std::lock_guard<std::mutex> lock(mu);
    const std::set<uint64_t> done(request.finished_request_ids().begin(),
                                  request.finished_request_ids().end());
    decode_finished.emplace_back(done.begin(), done.end());
    for (uint64_t id : done) preempted.erase(id);
    std::vector<uint64_t> live;
    for (const pb::CachedBatch& b : request.batches()) {
      EXPECT_TRUE(batches.count(b.id())) << "unknown batch " << b.id();
      for (uint64_t id : batches[b.id()]) {
        if (!done.count(id)) live.push_back(id);
      }
      batches.erase(b.id());
    }
    pb::DecodeResponse response;
    std::erase_if(live, [&](uint64_t id) {
      if (!preempt_next.erase(id)) return false;
      preempted.insert(id);
      response.add_preempted_request_ids(id);
      return true;
    });
    response.set_forward_ns(2000000);
    size_t held = 0;
    for (uint64_t id : live) {
      Generate(id, &response);
      held += requests[id].input_ids_size() + generated[id];
    }
    max_held = std::max(max_held, held);
    decode_sizes.push_back(live.size());
    if (!live.empty()) {
      batches[request.batches(0).id()] = live;
      *response.mutable_batch() = Describe(request.batches(0).id());
    }
    return response;
  }

  absl::StatusOr<pb::FilterBatchResponse> FilterBatch(
      const pb::FilterBatchRequest& request) override {
    std::lock_guard<std::mutex> lock(mu);
    batches[request.batch_id()].assign(request.request_ids().begin(), request.request_ids().end());
    pb::FilterBatchResponse response;
    *response.mutable_batch() = Describe(request.batch_id());
    if (batches[request.batch_id()].empty()) batches.erase(request.batch_id());
    return response;
  }

  absl::StatusOr<uint32_t> PrefixLookup(const std::string&) override {
    return absl::UnimplementedError("no prefixes in the fake shard");
  }

  absl::Status ClearCache(std::optional<uint64_t> id) override {
    std::lock_guard<std::mutex> lock(mu);
    if (id.has_value()) {
      batches.erase(*id);
    } else {
      batches.clear();
      preempted.clear();
    }
    return absl::OkStatus();
  }

  size_t Live() {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (const auto& [id, reqs] : batches) n += reqs.size();
    return n;
  }

  std::mutex mu;
  std::map<uint64_t, pb::Request> requests;
  std::map<uint64_t, std::vector<uint64_t>> batches;
  std::map<uint64_t, uint32_t> generated;
  std::vector<std::vector<uint64_t>> prefills;
  std::vector<std::vector<uint64_t>> decode_finished;
  std::vector<size_t> decode_sizes;
  size_t max_held = 0;           // most KV tokens the live requests held at a decode
  std::set<uint64_t> preempted;  // preempted and neither resumed nor released
  std::vector<uint64_t> resumed;

 private:
  template <typename Response>
  void Generate(uint64_t id, Response* response) {
    const uint32_t step = generated[id]++;
    const std::vector<int32_t>& script = scripts[id];
    pb::Generation* g = response->add_generations();
    g->set_request_id(id);
    const int32_t token = step < script.size() ? script[step] : filler;
    g->mutable_token()->set_token_id(static_cast<uint32_t>(token));
    g->mutable_token()->set_logprob(-0.5f);
    g->mutable_token()->set_rank(1);
  }

  pb::CachedBatch Describe(uint64_t batch_id) {
    pb::CachedBatch b;
    b.set_id(batch_id);
    for (uint64_t id : batches[batch_id]) b.add_request_ids(id);
    b.set_size(static_cast<uint32_t>(batches[batch_id].size()));
    return b;
  }
};

class RecordingSink final : public ResponseSink {
 public:
  void Send(fmaas::GenerationResponse message) override {
    std::lock_guard<std::mutex> lock(mu_);
    messages_.push_back(std::move(message));
    cv_.notify_all();
  }
  void Finish(absl::StatusOr<fmaas::GenerationResponse> last) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_FALSE(final_.has_value()) << "finished twice";
    final_ = std::move(last);
    cv_.notify_all();
  }
  bool Cancelled() const override { return cancelled; }

  // Waits for Finish; returns its argument.
  absl::StatusOr<fmaas::GenerationResponse> Result() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, 10s, [&] { return final_.has_value(); })) {
      return absl::DeadlineExceededError("the request never finished");
    }
    return *final_;
  }
  // Waits until at least n messages were sent.
  bool WaitMessages(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return messages_.size() >= n; });
  }
  std::vector<fmaas::GenerationResponse> messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_;
  }

  std::atomic<bool> cancelled{false};

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<fmaas::GenerationResponse> messages_;
  std::optional<absl::StatusOr<fmaas::GenerationResponse>> final_;
};

class BatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Tokenizer::FromDirectory(std::string(TGIS_FIXTURES_DIR) + "/models/gpt2");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = std::move(*t);
    eos_ = *tokenizer_->special_ids().eos;
    config_.admission = {.max_batch_size = 8, .max_batch_tokens = 4096, .block_size = 4};
    config_.max_waiting_tokens = 4;
    config_.detokenization.eos_token_ids = {eos_};
    config_.detokenization.placeholder_id = ContinuationPlaceholder(*tokenizer_);
  }

  void StartBatcher() {
    batcher_ = std::make_unique<Batcher>(shard_, *tokenizer_, config_);
    batcher_->Start();
  }

  std::vector<int32_t> Ids(const std::string& text) { return tokenizer_->Encode(text, false)->ids; }

  // A request for `prompt` whose generated tokens will be `script`.
  std::unique_ptr<GenerationRequest> Request(const std::string& prompt,
                                             const std::vector<int32_t>& script,
                                             GenerationParams params, bool streaming,
                                             std::shared_ptr<RecordingSink>* sink) {
    auto r = std::make_unique<GenerationRequest>();
    r->id = next_id_++;
    r->log_name = "test " + std::to_string(r->id);
    r->input_text = prompt;
    r->input_ids = Ids(prompt);
    r->params = std::move(params);
    r->streaming = streaming;
    *sink = std::make_shared<RecordingSink>();
    r->sink = *sink;
    r->received = Clock::now();
    shard_.scripts[r->id] = script;
    return r;
  }

  absl::StatusOr<fmaas::GenerationResponse> RunOne(std::unique_ptr<GenerationRequest> r,
                                                   std::shared_ptr<RecordingSink> sink) {
    std::vector<std::unique_ptr<GenerationRequest>> batch;
    batch.push_back(std::move(r));
    batcher_->Enqueue(std::move(batch));
    return sink->Result();
  }

  // Runs the same request unary and streamed; checks that they agree, returns the unary one.
  fmaas::GenerationResponse RunBothWays(const std::string& prompt,
                                        const std::vector<int32_t>& script,
                                        const GenerationParams& params) {
    std::shared_ptr<RecordingSink> unary_sink, stream_sink;
    auto unary_request = Request(prompt, script, params, false, &unary_sink);
    auto unary = RunOne(std::move(unary_request), unary_sink);
    auto stream_request = Request(prompt, script, params, true, &stream_sink);
    const fmaas::GenerationResponse header = StreamHeader(*stream_request);
    auto last = RunOne(std::move(stream_request), stream_sink);
    EXPECT_TRUE(unary.ok()) << unary.status();
    EXPECT_TRUE(last.ok()) << last.status();
    if (!unary.ok() || !last.ok()) return {};
    std::vector<fmaas::GenerationResponse> all{header};
    for (auto& m : stream_sink->messages()) all.push_back(m);
    all.push_back(*last);
    std::string text;
    std::vector<std::string> tokens;
    uint32_t count = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      text += all[i].text();
      for (const auto& t : all[i].tokens()) tokens.push_back(t.text());
      if (i > 0 && i + 1 < all.size()) {
        EXPECT_EQ(all[i].stop_reason(), fmaas::NOT_FINISHED);
        EXPECT_GT(all[i].generated_token_count(), count);
      }
      count = std::max(count, all[i].generated_token_count());
    }
    EXPECT_EQ(text, unary->text());
    std::vector<std::string> unary_tokens;
    for (const auto& t : unary->tokens()) unary_tokens.push_back(t.text());
    EXPECT_EQ(tokens, unary_tokens);
    EXPECT_EQ(last->generated_token_count(), unary->generated_token_count());
    EXPECT_EQ(last->stop_reason(), unary->stop_reason());
    EXPECT_EQ(last->stop_sequence(), unary->stop_sequence());
    EXPECT_EQ(header.input_token_count(), unary->input_token_count());
    return *unary;
  }

  FakeShard shard_;
  std::unique_ptr<Tokenizer> tokenizer_;
  int32_t eos_ = 0;
  BatcherConfig config_;
  std::unique_ptr<Batcher> batcher_;
  uint64_t next_id_ = 1;
};

GenerationParams Params(uint32_t max_new) {
  GenerationParams p;
  p.max_new_tokens = max_new;
  return p;
}

TEST_F(BatcherTest, MaxTokensText) {
  StartBatcher();
  const std::vector<int32_t> script = Ids(" the quick brown fox");
  fmaas::GenerationResponse r =
      RunBothWays("Hello", script, Params(static_cast<uint32_t>(script.size())));
  EXPECT_EQ(r.text(), " the quick brown fox");
  EXPECT_EQ(r.generated_token_count(), script.size());
  EXPECT_EQ(r.stop_reason(), fmaas::MAX_TOKENS);
  EXPECT_EQ(r.input_token_count(), Ids("Hello").size());

  GenerationParams clipped = Params(2);
  clipped.max_is_token_limit = true;
  EXPECT_EQ(RunBothWays("Hello", script, clipped).stop_reason(), fmaas::TOKEN_LIMIT);
}

TEST_F(BatcherTest, EosOnlyAfterMinNewTokens) {
  StartBatcher();
  std::vector<int32_t> script = Ids(" a b");
  const size_t n = script.size();
  script.push_back(eos_);
  for (int32_t id : Ids(" c")) script.push_back(id);
  script.push_back(eos_);

  fmaas::GenerationResponse r = RunBothWays("x", script, Params(20));
  EXPECT_EQ(r.stop_reason(), fmaas::EOS_TOKEN);
  EXPECT_EQ(r.generated_token_count(), n + 1);
  EXPECT_EQ(r.text(), " a b");  // EOS is a special token: not in the text

  GenerationParams min = Params(20);
  min.min_new_tokens = static_cast<uint32_t>(n + 2);
  r = RunBothWays("x", script, min);
  EXPECT_EQ(r.stop_reason(), fmaas::EOS_TOKEN);
  EXPECT_EQ(r.generated_token_count(), script.size());
  EXPECT_EQ(r.text(), " a b c");
}

TEST_F(BatcherTest, OutputSpecialTokens) {
  config_.detokenization.skip_special_tokens = false;
  StartBatcher();
  std::vector<int32_t> script = Ids(" a");
  script.push_back(eos_);
  fmaas::GenerationResponse r = RunBothWays("x", script, Params(20));
  EXPECT_EQ(r.text(), " a" + *tokenizer_->IdToToken(eos_));
}

TEST_F(BatcherTest, StopSequencesAcrossTokens) {
  StartBatcher();
  const std::vector<int32_t> script = Ids(" the capital of France is Paris, of course");
  GenerationParams p = Params(40);
  p.stop_sequences = {"Pari", "zzz"};
  p.include_stop_sequence = true;
  fmaas::GenerationResponse r = RunBothWays("Q:", script, p);
  EXPECT_EQ(r.stop_reason(), fmaas::STOP_SEQUENCE);
  EXPECT_EQ(r.stop_sequence(), "Pari");
  EXPECT_EQ(r.text(), " the capital of France is Pari");

  p.include_stop_sequence = false;
  p.stop_sequences = {"of France is Pa"};
  r = RunBothWays("Q:", script, p);
  EXPECT_EQ(r.stop_reason(), fmaas::STOP_SEQUENCE);
  EXPECT_EQ(r.text(), " the capital ");

  // Not before min_new_tokens.
  p.min_new_tokens = static_cast<uint32_t>(script.size());
  p.max_new_tokens = static_cast<uint32_t>(script.size());
  r = RunBothWays("Q:", script, p);
  EXPECT_EQ(r.stop_reason(), fmaas::MAX_TOKENS);
  EXPECT_EQ(r.text(), " the capital of France is Paris, of course");
}

TEST_F(BatcherTest, TokenDetailsAndInputTokens) {
  StartBatcher();
  const std::vector<int32_t> script = Ids(" one two three");
  GenerationParams p = Params(static_cast<uint32_t>(script.size()));
  p.response.generated_tokens = true;
  p.response.input_tokens = true;
  p.response.token_logprobs = true;
  p.response.token_ranks = true;
  p.response.input_text = true;
  std::shared_ptr<RecordingSink> sink;
  auto request = Request("Hello world", script, p, false, &sink);
  auto r = RunOne(std::move(request), sink);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->text(), "Hello world one two three");
  ASSERT_EQ(r->tokens_size(), static_cast<int>(script.size()));
  EXPECT_EQ(r->tokens(0).text(), *tokenizer_->IdToToken(script[0]));
  EXPECT_EQ(r->tokens(0).rank(), 1u);
  EXPECT_FLOAT_EQ(r->tokens(0).logprob(), -0.5f);
  const std::vector<int32_t> prompt = Ids("Hello world");
  ASSERT_EQ(r->input_tokens_size(), static_cast<int>(prompt.size()));
  EXPECT_TRUE(std::isnan(r->input_tokens(0).logprob()));  // nothing predicts the first token
  EXPECT_EQ(r->input_tokens(1).text(), *tokenizer_->IdToToken(prompt[1]));
  // The prompt details were asked of the shard.
  std::lock_guard<std::mutex> lock(shard_.mu);
  EXPECT_TRUE(shard_.requests.rbegin()->second.input_logprobs());
}

TEST_F(BatcherTest, CancelledRequestLeavesTheBatch) {
  shard_.step_delay = 2ms;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  auto a = Request("a", {}, Params(400), true, &a_sink);
  auto b = Request("b", {}, Params(60), false, &b_sink);
  const uint64_t a_id = a->id;
  std::vector<std::unique_ptr<GenerationRequest>> both;
  both.push_back(std::move(a));
  both.push_back(std::move(b));
  batcher_->Enqueue(std::move(both));
  ASSERT_TRUE(a_sink->WaitMessages(3));
  a_sink->cancelled = true;
  batcher_->Notify();
  auto a_result = a_sink->Result();
  EXPECT_EQ(a_result.status().code(), absl::StatusCode::kCancelled);
  auto b_result = b_sink->Result();
  ASSERT_TRUE(b_result.ok());
  EXPECT_EQ(b_result->generated_token_count(), 60u);
  std::lock_guard<std::mutex> lock(shard_.mu);
  bool freed = false;
  for (const auto& ids : shard_.decode_finished) {
    if (std::count(ids.begin(), ids.end(), a_id)) freed = true;
  }
  EXPECT_TRUE(freed) << "the cancelled request's id never reached the shard";
  EXPECT_LT(shard_.generated[a_id], 100u);
}

TEST_F(BatcherTest, ShardErrorFailsOnlyThatRequest) {
  StartBatcher();
  std::shared_ptr<RecordingSink> bad_sink, good_sink;
  auto bad = Request("a", {}, Params(5), false, &bad_sink);
  auto good = Request("b", Ids(" fine"), Params(static_cast<uint32_t>(Ids(" fine").size())), false,
                      &good_sink);
  shard_.refuse.insert(bad->id);
  std::vector<std::unique_ptr<GenerationRequest>> both;
  both.push_back(std::move(bad));
  both.push_back(std::move(good));
  batcher_->Enqueue(std::move(both));
  auto bad_result = bad_sink->Result();
  // TGIS answers every error after validation with UNKNOWN, whatever the shard's code.
  EXPECT_EQ(bad_result.status().code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(bad_result.status().message(), "Request failed during generation: bad request");
  auto good_result = good_sink->Result();
  ASSERT_TRUE(good_result.ok());
  EXPECT_EQ(good_result->text(), " fine");
}

TEST_F(BatcherTest, AdmissionWaitsForKvSpace) {
  // Room for one 40-token request at a time.
  config_.admission.max_batch_tokens = 48;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  auto a = Request("a", {}, Params(30), false, &a_sink);
  auto b = Request("b", {}, Params(30), false, &b_sink);
  const uint64_t a_id = a->id, b_id = b->id;
  std::vector<std::unique_ptr<GenerationRequest>> both;
  both.push_back(std::move(a));
  both.push_back(std::move(b));
  batcher_->Enqueue(std::move(both));
  ASSERT_TRUE(a_sink->Result().ok());
  ASSERT_TRUE(b_sink->Result().ok());
  std::lock_guard<std::mutex> lock(shard_.mu);
  ASSERT_EQ(shard_.prefills.size(), 2u);
  EXPECT_EQ(shard_.prefills[0], std::vector<uint64_t>{a_id});
  EXPECT_EQ(shard_.prefills[1], std::vector<uint64_t>{b_id});
  EXPECT_LE(shard_.max_held, 48u);
}

// Preemption: a request the shard preempts leaves the decode batch, is resumed (before any new
// request is admitted) and finishes with all its tokens.
TEST_F(BatcherTest, PreemptedRequestResumesAndFinishes) {
  config_.admission.lookahead_steps = 4;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  const std::vector<int32_t> a_script = Ids(" one two three four five six");
  const std::vector<int32_t> b_script = Ids(" seven eight nine ten");
  auto a = Request("a", a_script, Params(static_cast<uint32_t>(a_script.size())), false, &a_sink);
  auto b = Request("b", b_script, Params(static_cast<uint32_t>(b_script.size())), true, &b_sink);
  const uint64_t b_id = b->id;
  shard_.preempt_next.insert(b_id);
  std::vector<std::unique_ptr<GenerationRequest>> both;
  both.push_back(std::move(a));
  both.push_back(std::move(b));
  batcher_->Enqueue(std::move(both));
  auto a_result = a_sink->Result();
  auto b_result = b_sink->Result();
  ASSERT_TRUE(a_result.ok()) << a_result.status();
  ASSERT_TRUE(b_result.ok()) << b_result.status();
  EXPECT_EQ(a_result->text(), " one two three four five six");
  std::string streamed;
  for (const auto& m : b_sink->messages()) streamed += m.text();
  EXPECT_EQ(streamed + b_result->text(), " seven eight nine ten");
  EXPECT_EQ(b_result->generated_token_count(), b_script.size());
  std::lock_guard<std::mutex> lock(shard_.mu);
  EXPECT_EQ(shard_.resumed, std::vector<uint64_t>{b_id});
  EXPECT_TRUE(shard_.preempted.empty());
}

// A request cancelled while preempted is answered at once and released on the shard.
TEST_F(BatcherTest, CancelledWhilePreemptedIsReleased) {
  config_.admission.lookahead_steps = 4;
  shard_.step_delay = 1ms;
  shard_.hold = true;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  auto a = Request("a", {}, Params(300), true, &a_sink);
  auto b = Request("b", {}, Params(300), true, &b_sink);
  const uint64_t b_id = b->id;
  shard_.preempt_next.insert(b_id);
  std::vector<std::unique_ptr<GenerationRequest>> both;
  both.push_back(std::move(a));
  both.push_back(std::move(b));
  batcher_->Enqueue(std::move(both));
  ASSERT_TRUE(a_sink->WaitMessages(5));
  b_sink->cancelled = true;
  batcher_->Notify();
  EXPECT_EQ(b_sink->Result().status().code(), absl::StatusCode::kCancelled);
  a_sink->cancelled = true;
  batcher_->Notify();
  EXPECT_EQ(a_sink->Result().status().code(), absl::StatusCode::kCancelled);
  batcher_->Stop();
  std::lock_guard<std::mutex> lock(shard_.mu);
  EXPECT_TRUE(shard_.preempted.empty()) << "the preempted request was never released";
  EXPECT_TRUE(shard_.resumed.empty());
}

TEST_F(BatcherTest, NewRequestsJoinTheRunningBatch) {
  shard_.step_delay = 1ms;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  auto a = Request("a", {}, Params(200), true, &a_sink);
  std::vector<std::unique_ptr<GenerationRequest>> first;
  first.push_back(std::move(a));
  batcher_->Enqueue(std::move(first));
  ASSERT_TRUE(a_sink->WaitMessages(10));
  auto b = Request("b", {}, Params(5), false, &b_sink);
  std::vector<std::unique_ptr<GenerationRequest>> second;
  second.push_back(std::move(b));
  batcher_->Enqueue(std::move(second));
  ASSERT_TRUE(b_sink->Result().ok());
  ASSERT_TRUE(a_sink->Result().ok());
  std::lock_guard<std::mutex> lock(shard_.mu);
  EXPECT_EQ(shard_.prefills.size(), 2u);
  EXPECT_NE(std::find(shard_.decode_sizes.begin(), shard_.decode_sizes.end(), 2u),
            shard_.decode_sizes.end())
      << "the second request never decoded together with the first";
}

TEST_F(BatcherTest, TimeLimit) {
  StartBatcher();
  // Past already when queued: TIME_LIMIT without a token.
  GenerationParams p = Params(10);
  p.deadline = Clock::now() - 1ms;
  std::shared_ptr<RecordingSink> sink;
  auto request = Request("abc", {}, p, false, &sink);
  auto r = RunOne(std::move(request), sink);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->stop_reason(), fmaas::TIME_LIMIT);
  EXPECT_EQ(r->generated_token_count(), 0u);
  EXPECT_EQ(r->input_token_count(), Ids("abc").size());

  // Passing while it runs, unary and streamed.
  shard_.step_delay = 5ms;
  for (bool streaming : {false, true}) {
    p = Params(1000);
    p.deadline = Clock::now() + 300ms;  // room for a first token on a loaded machine
    auto running = Request("abc", {}, p, streaming, &sink);
    r = RunOne(std::move(running), sink);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->stop_reason(), fmaas::TIME_LIMIT);
    EXPECT_GE(r->generated_token_count(), 1u);
    EXPECT_LT(r->generated_token_count(), 1000u);
  }
}

TEST_F(BatcherTest, StopAnswersEveryone) {
  shard_.step_delay = 5ms;
  StartBatcher();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  std::vector<std::unique_ptr<GenerationRequest>> batch;
  batch.push_back(Request("a", {}, Params(1000), false, &a_sink));
  batch.push_back(Request("b", {}, Params(1000), true, &b_sink));
  batcher_->Enqueue(std::move(batch));
  std::this_thread::sleep_for(30ms);
  batcher_->Stop();
  EXPECT_EQ(a_sink->Result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(b_sink->Result().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(shard_.Live(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Metrics and health

class BatcherMetricsTest : public BatcherTest {
 protected:
  // The batcher (the base's) stops before the metrics it updates are destroyed (found by
  // AddressSanitizer: its loop set a gauge of a destroyed registry).
  ~BatcherMetricsTest() override {
    if (batcher_ != nullptr) batcher_->Stop();
  }

  void StartWithMetrics() {
    config_.metrics = &m_;
    config_.on_generation_result = [this](bool ok) { (ok ? successes_ : failures_)++; };
    StartBatcher();
  }
  double Count(metrics::Family* f, const metrics::LabelValues& labels = {}) {
    return f->Value(labels);
  }

  metrics::Registry registry_;
  metrics::TgiMetrics m_{&registry_};
  std::atomic<int> successes_{0}, failures_{0};
};

TEST_F(BatcherMetricsTest, RequestAndForwardPasses) {
  StartWithMetrics();
  std::shared_ptr<RecordingSink> sink;
  auto r = Request("Hello", Ids(" a b c"), Params(3), false, &sink);
  r->kind = RequestKind::kSingle;
  const uint32_t input = r->input_length();
  ASSERT_TRUE(RunOne(std::move(r), sink).ok());
  batcher_->Stop();  // the loop's last gauge update is done
  EXPECT_EQ(Count(m_.request_success, {"MAX_TOKENS", "single"}), 1);
  EXPECT_EQ(Count(m_.request_generated_tokens), 1);  // one observation
  EXPECT_EQ(Count(m_.request_total_tokens), 1);
  EXPECT_EQ(Count(m_.request_duration), 1);
  EXPECT_EQ(Count(m_.request_inference_duration), 1);
  EXPECT_EQ(Count(m_.request_mean_time_per_token_duration), 1);
  EXPECT_EQ(Count(m_.request_queue_duration), 1);
  // One prefill (first token), two decodes.
  EXPECT_EQ(Count(m_.batch_inference_count, {"prefill"}), 1);
  EXPECT_EQ(Count(m_.batch_inference_success, {"prefill"}), 1);
  EXPECT_EQ(Count(m_.batch_inference_count, {"next_token"}), 2);
  EXPECT_EQ(Count(m_.batch_inference_success, {"next_token"}), 2);
  EXPECT_EQ(Count(m_.batch_inference_batch_size, {"next_token"}), 2);
  EXPECT_EQ(Count(m_.batch_inference_duration, {"prefill", "single_only"}), 1);
  EXPECT_EQ(Count(m_.batch_inference_forward_duration, {"next_token", "single_only"}), 2);
  EXPECT_EQ(Count(m_.batch_inference_tokproc_duration, {"next_token", "single_only"}), 2);
  EXPECT_EQ(Count(m_.batch_next_tokens), 1);
  EXPECT_EQ(Count(m_.batch_concatenation_count), 0);
  EXPECT_EQ(successes_, 3);
  EXPECT_EQ(failures_, 0);
  // Nothing runs or waits any more.
  EXPECT_EQ(Count(m_.batch_current_size), 0);
  EXPECT_EQ(Count(m_.batch_input_tokens), 0);
  EXPECT_EQ(Count(m_.batch_max_remaining_tokens), 0);
  EXPECT_EQ(Count(m_.queue_size), 0);
  const std::string text = registry_.Render();
  EXPECT_NE(text.find("tgi_request_total_tokens_sum " + std::to_string(input + 3) + "\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("tgi_batch_inference_forward_duration_sum{method=\"next_token\","
                      "makeup=\"single_only\"} 0.004\n"),
            std::string::npos);
}

TEST_F(BatcherMetricsTest, JoiningTheRunningBatchIsAConcatenation) {
  shard_.step_delay = 1ms;
  StartWithMetrics();
  std::shared_ptr<RecordingSink> a_sink, b_sink;
  std::vector<std::unique_ptr<GenerationRequest>> first, second;
  // "a" runs until cancelled, so "b" joins it however slowly this machine schedules the test.
  first.push_back(Request("a", {}, Params(1000), true, &a_sink));
  batcher_->Enqueue(std::move(first));
  ASSERT_TRUE(a_sink->WaitMessages(5));
  EXPECT_EQ(Count(m_.batch_current_size), 1);
  EXPECT_GT(Count(m_.batch_max_remaining_tokens), 900);
  second.push_back(Request("b", {}, Params(5), false, &b_sink));
  batcher_->Enqueue(std::move(second));
  ASSERT_TRUE(b_sink->Result().ok());
  a_sink->cancelled = true;
  batcher_->Notify();
  EXPECT_EQ(a_sink->Result().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Count(m_.batch_concatenation_count), 1);
  EXPECT_EQ(Count(m_.batch_inference_count, {"prefill"}), 2);
}

TEST_F(BatcherMetricsTest, FailuresCancellationsAndTimeouts) {
  StartWithMetrics();
  // Time limit passed while queued: TGIS counts a timeout failure and a TIME_LIMIT success.
  GenerationParams p = Params(10);
  p.deadline = Clock::now() - std::chrono::milliseconds(1);
  std::shared_ptr<RecordingSink> sink;
  auto expired = Request("abc", {}, p, true, &sink);
  expired->kind = RequestKind::kStream;
  ASSERT_TRUE(RunOne(std::move(expired), sink).ok());
  EXPECT_EQ(Count(m_.request_failure, {"timeout"}), 1);
  EXPECT_EQ(Count(m_.request_success, {"TIME_LIMIT", "stream"}), 1);
  // A client gone while it runs.
  shard_.step_delay = 1ms;
  auto cancelled = Request("abc", {}, Params(1000), true, &sink);
  std::vector<std::unique_ptr<GenerationRequest>> batch;
  batch.push_back(std::move(cancelled));
  batcher_->Enqueue(std::move(batch));
  ASSERT_TRUE(sink->WaitMessages(2));
  sink->cancelled = true;
  batcher_->Notify();
  EXPECT_EQ(sink->Result().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Count(m_.request_failure, {"cancelled"}), 1);
  // The shard is gone: the forward pass and the request fail.
  shard_.unavailable = true;
  auto failing = Request("abc", {}, Params(5), false, &sink);
  EXPECT_FALSE(RunOne(std::move(failing), sink).ok());
  EXPECT_EQ(Count(m_.batch_inference_failure, {"prefill", "connection"}), 1);
  EXPECT_EQ(Count(m_.request_failure, {"generate"}), 1);
  EXPECT_GE(failures_, 1);
}

TEST_F(BatcherMetricsTest, HealthCheckGeneration) {
  StartWithMetrics();
  std::promise<bool> done;
  batcher_->EnqueueHealthCheck([&done](bool ok) { done.set_value(ok); });
  auto ok = done.get_future();
  ASSERT_EQ(ok.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(ok.get());
  {
    std::lock_guard<std::mutex> lock(shard_.mu);
    ASSERT_EQ(shard_.prefills.size(), 1u);
    const pb::Request& r = shard_.requests[shard_.prefills[0][0]];
    EXPECT_EQ(r.max_new_tokens(), 1u);
    EXPECT_FALSE(r.parameters().do_sample());
  }
  // A real forward pass, but no request of any client. The batcher records the pass's metrics
  // after it has handed the token to the health check, so wait for them.
  for (int i = 0; i < 500 && Count(m_.batch_inference_success, {"prefill"}) < 1; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(Count(m_.batch_inference_success, {"prefill"}), 1);
  EXPECT_EQ(registry_.Render().find("tgi_request_success{"), std::string::npos);
  EXPECT_EQ(Count(m_.request_queue_duration), 0);

  shard_.unavailable = true;
  std::promise<bool> failed;
  batcher_->EnqueueHealthCheck([&failed](bool ok) { failed.set_value(ok); });
  auto not_ok = failed.get_future();
  ASSERT_EQ(not_ok.wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(not_ok.get());
  EXPECT_EQ(registry_.Render().find("tgi_request_failure{"), std::string::npos);
}

}  // namespace
}  // namespace tgis::router

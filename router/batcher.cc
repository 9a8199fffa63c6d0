#include "router/batcher.h"

#include <glog/logging.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "router/request_metrics.h"

namespace tgis::router {
namespace {

namespace pb = generate::v1;

pb::Request ToShardRequest(const GenerationRequest& r) {
  const GenerationParams& p = r.params;
  pb::Request out;
  out.set_id(r.id);
  out.mutable_input_ids()->Add(r.input_ids.begin(), r.input_ids.end());
  out.set_max_new_tokens(p.max_new_tokens);
  out.set_prefix_id(r.prefix_id);
  out.set_top_n_tokens(p.response.top_n_tokens);
  // The shard computes prompt details only when something beyond the token text is wanted.
  const ResponseOptions& o = p.response;
  out.set_input_logprobs(o.input_tokens && (o.token_logprobs || o.token_ranks || o.top_n_tokens));
  pb::SamplingParameters* s = out.mutable_parameters();
  s->set_do_sample(p.sample);
  if (p.sample) {
    s->set_temperature(p.temperature);
    s->set_top_k(p.top_k);
    s->set_top_p(p.top_p);
    s->set_typical_p(p.typical_p);
    s->set_seed(p.seed.value_or(0));
  }
  s->set_repetition_penalty(p.repetition_penalty);
  if (p.length_penalty.has_value()) {
    s->mutable_length_penalty()->set_start_index(p.length_penalty->start_index);
    s->mutable_length_penalty()->set_decay_factor(p.length_penalty->decay_factor);
  }
  s->set_min_new_tokens(p.min_new_tokens);
  if (p.guided != nullptr) {
    const grammar::ByteDfa& dfa = *p.guided;
    pb::ByteAutomaton* g = out.mutable_guided();
    g->set_byte_classes(std::string(dfa.byte_class.begin(), dfa.byte_class.end()));
    g->set_num_classes(static_cast<uint32_t>(dfa.num_classes));
    g->mutable_next()->Add(dfa.next.begin(), dfa.next.end());
    for (bool a : dfa.accepting) g->add_accepting(a);
  }
  return out;
}

// A short, log-safe view of generated text.
std::string Preview(std::string_view text) {
  constexpr size_t kMax = 32;
  if (text.size() <= kMax) return std::string(text);
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return std::string(text.substr(0, cut)) + "...";
}

// The sink of a health-check generation: no client, only whether it worked.
class HealthCheckSink final : public ResponseSink {
 public:
  explicit HealthCheckSink(std::function<void(bool)> done) : done_(std::move(done)) {}
  void Send(fmaas::GenerationResponse) override {}
  void Finish(absl::StatusOr<fmaas::GenerationResponse> last) override {
    done_(last.ok() && last->stop_reason() != fmaas::CANCELLED &&
          last->generated_token_count() > 0);
  }
  bool Cancelled() const override { return false; }

 private:
  std::function<void(bool)> done_;
};

// The prompt of health checks, as TGIS's.
constexpr char kHealthCheckInput[] = "liveness";

}  // namespace

Batcher::Batcher(ShardClient& shards, const Tokenizer& tokenizer, BatcherConfig config)
    : shards_(shards), tokenizer_(tokenizer), config_(std::move(config)) {}

Batcher::~Batcher() { Stop(); }

void Batcher::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Batcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Batcher::Enqueue(std::vector<std::unique_ptr<GenerationRequest>> requests) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (auto& r : requests) {
      r->queued = now;
      if (stop_) {
        EndRequest(*r, absl::UnavailableError("the server is shutting down"), 0);
        continue;
      }
      queue_.Push(std::move(r));
    }
    UpdateQueueGaugeLocked();
  }
  cv_.notify_all();
}

void Batcher::Notify() { cv_.notify_all(); }

void Batcher::EnqueueHealthCheck(std::function<void(bool)> done) {
  auto r = std::make_unique<GenerationRequest>();
  r->id = next_health_check_id_.fetch_add(1);
  r->log_name = absl::StrCat("health check ", r->id - (uint64_t{1} << 63) + 1);
  r->kind = RequestKind::kHealthCheck;
  r->input_text = kHealthCheckInput;
  absl::StatusOr<Encoding> encoding = tokenizer_.Encode(kHealthCheckInput, true);
  if (encoding.ok() && !encoding->ids.empty()) {
    r->input_ids = std::move(encoding->ids);
  } else {
    r->input_ids = {config_.detokenization.placeholder_id.value_or(0)};
  }
  r->params.max_new_tokens = 1;
  r->sink = std::make_shared<HealthCheckSink>(std::move(done));
  r->received = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    r->queued = r->received;
    if (stop_) {
      r->sink->Finish(absl::UnavailableError("the server is shutting down"));
      return;
    }
    queue_.PushFront(std::move(r));
    UpdateQueueGaugeLocked();
  }
  cv_.notify_all();
}

void Batcher::UpdateQueueGaugeLocked() {
  if (config_.metrics != nullptr) config_.metrics->queue_size->Set(queue_.size());
}

// Begins the step's span (when tracing) and ends it when the step is handled.
class Batcher::StepTrace {
 public:
  StepTrace(Batcher* b, const char* name) : b_(b) {
    if (!tracing::TracingEnabled()) return;
    b_->step_start_ = Clock::now();
    b_->step_name_ = name;
    b_->step_span_ =
        tracing::StartSpan(name, nullptr, tracing::SpanKind::kInternal, b_->step_start_);
  }
  ~StepTrace() { b_->step_span_.End(); }

 private:
  Batcher* b_;
};

void Batcher::TraceRequestStep(const tracing::SpanContext& request_span,
                               Clock::time_point handled) {
  if (!step_span_.recording() || !request_span.valid()) return;
  tracing::Span step =
      tracing::StartSpan(step_name_, &request_span, tracing::SpanKind::kInternal, step_start_);
  step.AddLink(step_span_.context());
  tracing::Span detokenize =
      tracing::StartSpan("detokenize", &step.context(), tracing::SpanKind::kInternal, handled);
  detokenize.End();
  step.End();
}

void Batcher::EndRequest(GenerationRequest& request, absl::StatusOr<fmaas::GenerationResponse> last,
                         uint32_t generated, bool expired_in_queue) {
  RecordRequestEnd(config_.metrics, request, last, generated, expired_in_queue, Clock::now());
  if (request.span.recording()) {
    request.span.SetAttribute("generated_tokens", static_cast<int64_t>(generated));
    if (last.ok()) {
      request.span.SetAttribute("stop_reason", fmaas::StopReason_Name(last->stop_reason()));
    } else {
      request.span.SetError(std::string(last.status().message()));
    }
    request.span.End();
  }
  request.sink->Finish(std::move(last));
}

void Batcher::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<GenerationRequest>> batch;
    RequestQueue::Removed removed;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        removed = queue_.RemoveCancelledAndExpired(Clock::now());
        if (stop_ || !running_.empty() || !queue_.empty() || !removed.cancelled.empty() ||
            !removed.expired.empty()) {
          break;
        }
        // Idle: sleep until a request arrives, or a queued one's time limit passes.
        if (auto deadline = queue_.EarliestDeadline()) {
          cv_.wait_until(lock, *deadline);
        } else {
          cv_.wait(lock);
        }
      }
      stopping = stop_;
      if (stopping) {
        for (auto& r : queue_.TakeAll()) removed.cancelled.push_back(std::move(r));
      } else {
        batch = TakeBatchLocked(Clock::now());
      }
      UpdateQueueGaugeLocked();
    }
    if (stopping) {
      for (auto& r : removed.cancelled) {
        LOG(WARNING) << r->log_name << ": dropped while queued: the shutdown grace period is over";
        EndRequest(*r, absl::UnavailableError("the server is shutting down"), 0);
      }
      for (auto& r : removed.expired) EndRequest(*r, EarlyTimeoutResponse(*r), 0, true);
      // Our own shutdown, not a generation error: UNAVAILABLE, which a client may retry
      // against another replica.
      for (const auto& [id, r] : running_) {
        LOG(WARNING) << r.request->log_name << ": stopped after " << r.progress->generated()
                     << " token(s): the shutdown grace period is over";
        EndRequest(*r.request, absl::UnavailableError("the server is shutting down"),
                   r.progress->generated());
      }
      running_.clear();
      batches_.clear();
      finished_.clear();
      UpdateBatchGauges();
      (void)shards_.ClearCache(std::nullopt);
      return;
    }
    AnswerRemoved(std::move(removed));
    DropCancelled();
    if (AnyPreempted()) Resume();
    if (!batch.empty()) Prefill(std::move(batch));
    if (AnyActive()) {
      Decode();
    } else if (running_.empty()) {
      ReleaseIdleBatches();
    }
    UpdateBatchGauges();
  }
}

std::vector<std::unique_ptr<GenerationRequest>> Batcher::TakeBatchLocked(Clock::time_point now) {
  if (queue_.empty()) return {};
  size_t min_size = 1;
  std::vector<Footprint> footprints;
  footprints.reserve(running_.size());
  uint32_t most_steps_left = 0;
  for (const auto& [id, r] : running_) {
    // Preempted requests are resumed before anything new is admitted.
    if (r.preempted) return {};
    const uint32_t generated = r.progress->generated();
    most_steps_left = std::max(most_steps_left, FootprintOf(*r.request, generated).steps);
    footprints.push_back(FootprintOf(*r.request, generated, config_.admission.lookahead_steps));
  }
  if (!running_.empty()) {
    // Leave a batch that finishes at the next step alone, and give decoding at least half as
    // long as the last prefill took before prefilling again.
    if (most_steps_left < 2 || now < next_prefill_after_) return {};
    const uint32_t wait = config_.max_waiting_tokens;
    if (running_.size() > 1 && steps_since_prefill_ < wait) {
      min_size = std::max<size_t>(1, running_.size() * (wait - steps_since_prefill_) / wait);
    }
  }
  AdmissionStats stats;
  auto batch = queue_.NextBatch(footprints, min_size, config_.admission, &stats);
  if (config_.metrics != nullptr) {
    if (stats.queue_jumps > 0) config_.metrics->queue_jump->Add(stats.queue_jumps);
    if (stats.prefill_weight_exceeded > 0) {
      config_.metrics->prefill_weight_limit_exceeded->Add(stats.prefill_weight_exceeded);
    }
    if (stats.prefill_padding_exceeded > 0) {
      config_.metrics->prefill_padding_limit_exceeded->Add(stats.prefill_padding_exceeded);
    }
    if (stats.granular_additions > 0) {
      config_.metrics->granular_batch_addition->Add(stats.granular_additions);
    }
  }
  if (batch.empty() && running_.empty()) {
    // Nothing fits even in an empty batch: the request at the head can never run. Startup
    // keeps max_sequence_length within the KV cache, so this is only a safety net.
    std::unique_ptr<GenerationRequest> head = queue_.PopFront();
    LOG(ERROR) << head->log_name << ": does not fit in the KV cache even alone";
    EndRequest(*head,
               absl::ResourceExhaustedError("the request does not fit in the KV cache even alone"),
               0);
  }
  return batch;
}

void Batcher::AnswerRemoved(RequestQueue::Removed removed) {
  for (auto& r : removed.cancelled) {
    LOG(WARNING) << r->log_name << ": cancelled by the client while queued";
    EndRequest(*r, absl::CancelledError("cancelled by the client"), 0);
  }
  for (auto& r : removed.expired) {
    LOG(WARNING) << r->log_name << ": time limit reached while queued";
    EndRequest(*r, EarlyTimeoutResponse(*r), 0, /*expired_in_queue=*/true);
  }
}

void Batcher::DropCancelled() {
  for (auto it = running_.begin(); it != running_.end();) {
    auto next = std::next(it);
    if (it->second.request->sink->Cancelled()) {
      LOG(WARNING) << it->second.request->log_name << ": cancelled by the client after "
                   << it->second.progress->generated() << " token(s)";
      finished_.push_back(it->first);
      Finish(it, absl::CancelledError("cancelled by the client"));
    }
    it = next;
  }
}

void Batcher::Prefill(std::vector<std::unique_ptr<GenerationRequest>> batch) {
  if (!finished_.empty()) FilterFinished();
  StepTrace trace(this, "prefill");
  pb::PrefillRequest request;
  pb::Batch* b = request.mutable_batch();
  b->set_id(next_batch_id_++);
  size_t tokens = 0;
  const size_t running_before = running_.size();
  const Clock::time_point admitted = Clock::now();
  metrics::TgiMetrics* m = config_.metrics;
  for (auto& r : batch) {
    pb::Request* shard_request = b->add_requests();
    *shard_request = ToShardRequest(*r);
    shard_request->set_speculate_tokens(r->speculate_tokens.value_or(config_.speculate_tokens));
    tokens += r->input_ids.size();
    r->batched = admitted;
    if (r->span.recording()) {
      tracing::Span queue =
          tracing::StartSpan("queue", &r->span.context(), tracing::SpanKind::kInternal, r->queued);
      queue.End(admitted);
    }
    if (m != nullptr && r->kind != RequestKind::kHealthCheck) {
      m->request_queue_duration->Observe(Seconds(admitted - r->queued));
    }
    auto progress = std::make_unique<RequestProgress>(tokenizer_, config_.detokenization, *r);
    const uint64_t id = r->id;
    running_.emplace(id, Running{std::move(r), std::move(progress)});
  }
  LOG(INFO) << "prefill of batch #" << b->id() << ": " << b->requests_size() << " new request(s), "
            << tokens << " prompt tokens; " << running_.size() << " request(s) in the batch now";
  if (m != nullptr) {
    // Ragged batches: no padding, the prompt tokens are all the tokens.
    m->batch_next_tokens->Observe(static_cast<double>(tokens));
    m->batch_inference_batch_size->Observe(b->requests_size(), {"prefill"});
  }
  Clock::time_point start, end;
  std::optional<pb::PrefillResponse> response = CallPrefill(&request, "prefill", &start, &end);
  next_prefill_after_ = end + (end - start) / 2;
  steps_since_prefill_ = 0;
  if (!response.has_value()) return;
  for (const pb::Generation& g : response->generations()) OnGeneration(g, /*prefill=*/true);
  for (uint64_t id : response->prefilling_request_ids()) {
    if (auto it = running_.find(id); it != running_.end()) it->second.prefilling = true;
  }
  if (response->has_batch()) batches_.push_back(response->batch());
  OnInferenceDone("prefill", absl::OkStatus(), end - start, response->forward_ns(),
                  Clock::now() - end);
  if (m != nullptr && running_before > 0) {
    // The new requests joined a running batch (those that did not finish at their first token).
    const bool joined =
        std::any_of(b->requests().begin(), b->requests().end(),
                    [this](const pb::Request& r) { return running_.count(r.id()); });
    if (joined) m->batch_concatenation_count->Add(1);
  }
}

void Batcher::OnInferenceDone(const char* method, const absl::Status& status,
                              Clock::duration duration, uint64_t forward_ns,
                              Clock::duration tokproc) {
  if (config_.on_generation_result) config_.on_generation_result(status.ok());
  metrics::TgiMetrics* m = config_.metrics;
  if (m == nullptr) return;
  m->batch_inference_count->Add(1, {method});
  if (!status.ok()) {
    m->batch_inference_failure->Add(1, {method, InferenceFailureReason(status)});
    return;
  }
  m->batch_inference_success->Add(1, {method});
  m->batch_inference_duration->Observe(Seconds(duration), {method, kBatchMakeup});
  m->batch_inference_forward_duration->Observe(static_cast<double>(forward_ns) / 1e9,
                                               {method, kBatchMakeup});
  m->batch_inference_tokproc_duration->Observe(Seconds(tokproc), {method, kBatchMakeup});
}

void Batcher::UpdateBatchGauges() {
  metrics::TgiMetrics* m = config_.metrics;
  if (m == nullptr) return;
  // As TGIS's README describes them: input tokens counts the prompts and the tokens generated
  // so far (the KV cache in use; there is no padding), max remaining tokens the largest number
  // of tokens a running request may still generate.
  uint64_t tokens = 0;
  uint32_t most_remaining = 0;
  for (const auto& [id, r] : running_) {
    const uint32_t generated = r.progress->generated();
    tokens += r.request->input_length() + generated;
    const uint32_t max_new = r.request->params.max_new_tokens;
    most_remaining = std::max(most_remaining, max_new > generated ? max_new - generated : 0);
  }
  m->batch_current_size->Set(static_cast<double>(running_.size()));
  m->batch_input_tokens->Set(static_cast<double>(tokens));
  m->batch_max_remaining_tokens->Set(most_remaining);
}

void Batcher::Decode() {
  if (batches_.empty()) {
    // Every running request lives in some cached batch; this would be a bookkeeping bug.
    LOG(ERROR) << running_.size() << " running request(s) but no cached batch";
    FailAllRunning(absl::InternalError("the request was lost by the batcher"));
    return;
  }
  StepTrace trace(this, "decode");
  pb::DecodeRequest request;
  if (step_span_.recording()) request.set_traceparent(step_span_.context().Traceparent());
  for (const pb::CachedBatch& b : batches_) *request.add_batches() = b;
  request.mutable_finished_request_ids()->Add(finished_.begin(), finished_.end());
  request.set_max_prompt_tokens(config_.prefill_chunk_tokens);
  const size_t size_before = running_.size();
  // A speculating request's step may bring tokens past its end (a stop sequence, EOS): the
  // request is gone by then and they are dropped.
  std::set<uint64_t> speculating;
  for (const auto& [id, r] : running_) {
    if (r.request->speculate_tokens.value_or(config_.speculate_tokens) > 0) speculating.insert(id);
  }
  if (config_.metrics != nullptr) {
    config_.metrics->batch_inference_batch_size->Observe(static_cast<double>(size_before),
                                                         {"next_token"});
  }
  const Clock::time_point start = Clock::now();
  absl::StatusOr<pb::DecodeResponse> response = shards_.Decode(request);
  const Clock::time_point end = Clock::now();
  batches_.clear();
  finished_.clear();
  ++steps_since_prefill_;
  SetShardHealth(response.ok());
  if (!response.ok()) {
    OnInferenceDone("next_token", response.status(), end - start, 0, {});
    LOG(ERROR) << "decode failed: " << response.status();
    FailAllRunning(response.status());
    (void)shards_.ClearCache(std::nullopt);
    return;
  }
  for (const pb::RequestError& e : response->errors()) {
    FailRequest(e.request_id(), absl::Status(static_cast<absl::StatusCode>(e.code()), e.message()));
  }
  for (uint64_t id : response->preempted_request_ids()) {
    auto it = running_.find(id);
    if (it == running_.end()) continue;
    it->second.preempted = true;
    LOG(INFO) << it->second.request->log_name << ": preempted after "
              << it->second.progress->generated()
              << " token(s): the KV cache is full; it resumes when blocks free up";
    if (config_.metrics != nullptr) config_.metrics->preemptions->Add(1);
  }
  if (config_.metrics != nullptr && response->draft_tokens() > 0) {
    config_.metrics->draft_tokens->Add(response->draft_tokens());
    config_.metrics->accepted_draft_tokens->Add(response->accepted_draft_tokens());
  }
  for (const pb::Generation& g : response->generations()) {
    // A chunked prompt's first token: the request's prefill generation.
    auto it = running_.find(g.request_id());
    if (it == running_.end() && speculating.count(g.request_id())) continue;
    const bool first = it != running_.end() && it->second.prefilling;
    if (first) it->second.prefilling = false;
    OnGeneration(g, /*prefill=*/first);
  }
  if (response->has_batch()) batches_.push_back(response->batch());
  OnInferenceDone("next_token", absl::OkStatus(), end - start, response->forward_ns(),
                  Clock::now() - end);
  if (running_.size() != size_before) {
    VLOG(1) << "batch: " << running_.size() << " request(s) running";
  }
}

void Batcher::FilterFinished() {
  const std::set<uint64_t> done(finished_.begin(), finished_.end());
  // Finished while preempted: in no batch; the next Decode (or ClearCache) releases them.
  std::vector<uint64_t> unbatched = UnbatchedFinished();
  std::vector<pb::CachedBatch> kept;
  for (const pb::CachedBatch& b : batches_) {
    pb::FilterBatchRequest request;
    request.set_batch_id(b.id());
    bool any_done = false;
    for (uint64_t id : b.request_ids()) {
      if (done.count(id)) {
        any_done = true;
      } else {
        request.add_request_ids(id);
      }
    }
    if (!any_done) {
      kept.push_back(b);
      continue;
    }
    absl::StatusOr<pb::FilterBatchResponse> response = shards_.FilterBatch(request);
    if (!response.ok()) {
      // The next Decode still drops them.
      LOG(WARNING) << "filtering batch #" << b.id() << " failed: " << response.status();
      return;
    }
    if (request.request_ids_size() > 0) kept.push_back(response->batch());
  }
  batches_ = std::move(kept);
  finished_ = std::move(unbatched);
}

std::vector<uint64_t> Batcher::UnbatchedFinished() const {
  std::set<uint64_t> unbatched(finished_.begin(), finished_.end());
  for (const pb::CachedBatch& b : batches_) {
    for (uint64_t id : b.request_ids()) unbatched.erase(id);
  }
  return {unbatched.begin(), unbatched.end()};
}

void Batcher::ReleaseIdleBatches() {
  for (const pb::CachedBatch& b : batches_) {
    if (absl::Status s = shards_.ClearCache(b.id()); !s.ok()) {
      LOG(WARNING) << "clearing batch #" << b.id() << " failed: " << s;
    }
  }
  // Requests that finished while preempted are in no batch: nothing runs, so all can go.
  if (!UnbatchedFinished().empty()) {
    if (absl::Status s = shards_.ClearCache(std::nullopt); !s.ok()) {
      LOG(WARNING) << "clearing the shards' cache failed: " << s;
    }
  }
  batches_.clear();
  finished_.clear();
}

bool Batcher::AnyPreempted() const {
  return std::any_of(running_.begin(), running_.end(),
                     [](const auto& entry) { return entry.second.preempted; });
}

bool Batcher::AnyActive() const {
  return std::any_of(running_.begin(), running_.end(),
                     [](const auto& entry) { return !entry.second.preempted; });
}

void Batcher::Resume() {
  if (!finished_.empty()) FilterFinished();
  const uint32_t lookahead = config_.admission.lookahead_steps;
  std::vector<Footprint> footprints;
  std::vector<uint64_t> waiting;  // oldest first: ids grow with arrival
  for (const auto& [id, r] : running_) {
    if (r.preempted) {
      waiting.push_back(id);
    } else {
      footprints.push_back(FootprintOf(*r.request, r.progress->generated(), lookahead));
    }
  }
  const bool alone = footprints.empty();
  pb::PrefillRequest request;
  pb::Batch* b = request.mutable_batch();
  b->set_id(next_batch_id_++);
  for (uint64_t id : waiting) {
    const Running& r = running_.at(id);
    footprints.push_back(FootprintOf(*r.request, r.progress->generated(), lookahead));
    const bool fits =
        PeakTokens(footprints, config_.admission.block_size) <= config_.admission.max_batch_tokens;
    if (!fits && !(alone && b->requests_size() == 0)) break;
    pb::Request* resume = b->add_requests();
    resume->set_id(id);
    resume->set_resume(true);
  }
  if (b->requests_size() == 0) return;
  StepTrace trace(this, "resume");
  LOG(INFO) << "resuming " << b->requests_size() << " preempted request(s) in batch #" << b->id();
  Clock::time_point start, end;
  std::optional<pb::PrefillResponse> response = CallPrefill(&request, "resuming", &start, &end);
  if (!response.has_value()) return;
  // Resumed: all but those still preempted (a chunked one may have no token yet).
  const std::set<uint64_t> still(response->preempted_request_ids().begin(),
                                 response->preempted_request_ids().end());
  for (const pb::Request& r : b->requests()) {
    auto it = running_.find(r.id());
    if (it != running_.end() && !still.count(r.id())) it->second.preempted = false;
  }
  for (const pb::Generation& g : response->generations()) OnGeneration(g, /*prefill=*/false);
  if (response->has_batch()) batches_.push_back(response->batch());
  if (alone && response->preempted_request_ids_size() == b->requests_size()) {
    // Nothing else holds blocks and it still does not fit: it never will.
    finished_.push_back(b->requests(0).id());
    FailRequest(b->requests(0).id(), absl::ResourceExhaustedError(
                                         "the request does not fit in the KV cache even alone"));
  }
  OnInferenceDone("prefill", absl::OkStatus(), end - start, response->forward_ns(),
                  Clock::now() - end);
}

std::optional<pb::PrefillResponse> Batcher::CallPrefill(pb::PrefillRequest* request,
                                                        const char* what, Clock::time_point* start,
                                                        Clock::time_point* end) {
  request->set_max_prompt_tokens(config_.prefill_chunk_tokens);
  if (step_span_.recording()) request->set_traceparent(step_span_.context().Traceparent());
  *start = Clock::now();
  absl::StatusOr<pb::PrefillResponse> response = shards_.Prefill(*request);
  *end = Clock::now();
  SetShardHealth(response.ok());
  const pb::Batch& b = request->batch();
  if (!response.ok()) {
    OnInferenceDone("prefill", response.status(), *end - *start, 0, {});
    LOG(ERROR) << what << " of batch #" << b.id() << " failed: " << response.status();
    for (const pb::Request& r : b.requests()) FailRequest(r.id(), response.status());
    (void)shards_.ClearCache(b.id());
    return std::nullopt;
  }
  for (const pb::RequestError& e : response->errors()) {
    FailRequest(e.request_id(), absl::Status(static_cast<absl::StatusCode>(e.code()), e.message()));
  }
  if (metrics::TgiMetrics* m = config_.metrics; m != nullptr) {
    m->prefix_cache_hits->Add(response->prefix_cache_hits());
    m->prefix_cache_reused_tokens->Add(static_cast<double>(response->prefix_cache_reused_tokens()));
  }
  return *std::move(response);
}

void Batcher::OnGeneration(const pb::Generation& generation, bool prefill) {
  auto it = running_.find(generation.request_id());
  if (it == running_.end()) {
    LOG(WARNING) << "the shard returned a token for unknown request " << generation.request_id();
    return;
  }
  Running& r = it->second;
  // The request's span of this step, made however this function returns (the request may be
  // gone by then: only its span's context is kept).
  struct AtExit {
    std::function<void()> f;
    ~AtExit() {
      if (f) f();
    }
  } trace{step_span_.recording() ? std::function<void()>([this, parent = r.request->span.context(),
                                                          handled = Clock::now()] {
    TraceRequestStep(parent, handled);
  })
                                 : nullptr};
  if (prefill) {
    if (auto message = r.progress->AddInputTokens(generation.input_tokens())) {
      r.request->sink->Send(std::move(*message));
    }
  }
  absl::StatusOr<RequestProgress::Step> step =
      r.progress->AddToken(generation.token(), Clock::now());
  if (!step.ok()) {
    finished_.push_back(it->first);
    Finish(it, absl::InternalError(absl::StrCat("Request failed during detokenization: ",
                                                step.status().message())));
    return;
  }
  if (step->reason == fmaas::NOT_FINISHED) {
    if (step->message.has_value()) r.request->sink->Send(std::move(*step->message));
    return;
  }
  finished_.push_back(it->first);
  if (r.request->streaming) {
    Finish(it, std::move(*step->message));
  } else {
    Finish(it, r.progress->TakeUnaryResponse());
  }
}

void Batcher::Finish(std::map<uint64_t, Running>::iterator it,
                     absl::StatusOr<fmaas::GenerationResponse> last) {
  GenerationRequest& request = *it->second.request;
  if (last.ok() && last->stop_reason() != fmaas::CANCELLED) {
    const auto elapsed =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - request.received);
    LOG(INFO) << request.log_name << ": generated " << it->second.progress->generated()
              << " token(s) before " << fmaas::StopReason_Name(last->stop_reason()) << " in "
              << elapsed.count() << " ms (" << request.input_length() << " input tokens)"
              << (request.streaming ? ""
                                    : absl::StrCat(", output \"", Preview(last->text()), "\""));
  }
  EndRequest(request, std::move(last), it->second.progress->generated());
  running_.erase(it);
}

void Batcher::FailRequest(uint64_t id, const absl::Status& status) {
  auto it = running_.find(id);
  if (it == running_.end()) return;
  const uint32_t generated = it->second.progress->generated();
  // As TGIS words it and codes it: UNKNOWN whatever the shard said, never UNAVAILABLE, which
  // many gRPC clients retry on their own and so would run a generation twice.
  std::string message = generated == 0 ? std::string(status.message())
                                       : absl::StrCat("Error after generating ", generated,
                                                      " tokens: ", status.message());
  LOG(ERROR) << it->second.request->log_name << ": " << message;
  Finish(it, absl::UnknownError(absl::StrCat("Request failed during generation: ", message)));
}

void Batcher::SetShardHealth(bool healthy) {
  if (healthy == shards_healthy_) return;
  shards_healthy_ = healthy;
  if (healthy) {
    LOG(INFO) << "the shards are answering again";
  } else {
    LOG(ERROR) << "the shards are failing";
  }
  if (config_.on_shard_health) config_.on_shard_health(healthy);
}

void Batcher::FailAllRunning(const absl::Status& status) {
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : running_) ids.push_back(id);
  for (uint64_t id : ids) FailRequest(id, status);
  batches_.clear();
  finished_.clear();
}

}  // namespace tgis::router

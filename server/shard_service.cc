#include "server/shard_service.h"

#include <glog/logging.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <span>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda_ops.h"
#include "tracing/tracing.h"

namespace tgis::server {

namespace pb = generate::v1;

namespace {

// A guided request's automaton (the router compiled it), checked before it is trusted.
absl::StatusOr<std::shared_ptr<const grammar::ByteDfa>> GuidedFromProto(
    const pb::ByteAutomaton& g) {
  auto dfa = std::make_shared<grammar::ByteDfa>();
  if (g.byte_classes().size() != dfa->byte_class.size()) {
    return absl::InvalidArgumentError("guided decoding: the automaton's byte classes are not 256");
  }
  std::copy(g.byte_classes().begin(), g.byte_classes().end(), dfa->byte_class.begin());
  dfa->num_classes = static_cast<int32_t>(std::min<uint32_t>(g.num_classes(), 1u << 16));
  dfa->next.assign(g.next().begin(), g.next().end());
  dfa->accepting.assign(g.accepting().begin(), g.accepting().end());
  if (absl::Status st = dfa->Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("guided decoding: ", st.message()));
  }
  return std::shared_ptr<const grammar::ByteDfa>(std::move(dfa));
}

// Memory the KV cache may draw from: free GPU memory (after the weights) on CUDA, less the
// part of the device that CUDA_PROCESS_MEMORY_FRACTION keeps from this process; else the
// host's available memory.
uint64_t AvailableMemory(kernels::Device device, double process_fraction) {
#ifdef TGIS_WITH_CUDA
  if (device == kernels::Device::kCuda) {
    const double reserved =
        (1.0 - process_fraction) * static_cast<double>(kernels::cuda::TotalMemory());
    const double free_bytes = static_cast<double>(kernels::cuda::FreeMemory());
    return free_bytes > reserved ? static_cast<uint64_t>(free_bytes - reserved) : 0;
  }
#else
  (void)device;
  (void)process_fraction;
#endif
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

// A prefill's activation memory per prompt token, at its widest point: the residual stream and
// the normed copy, the fused q/k/v, the attention output and the MLP's up (and gate) outputs
// of one layer at a time, in the activation dtype, plus the f32 logits row of its last token
// spread over the prompt. An estimate on the safe side, not a measurement.
size_t PrefillBytesPerToken(const Model& model) {
  const DecoderSpec& spec = model.spec();
  const ShardLayout& shard = model.shard();
  const int64_t qkv = (shard.q_heads.size() + 2 * shard.kv_heads.size()) * spec.head_dim;
  const int64_t widest = 4 * spec.hidden + qkv + 3 * shard.intermediate.size();
  return static_cast<size_t>(widest) * kernels::DTypeSize(model.act_dtype()) + 4 * 64;
}

SamplingParams FromProto(const pb::SamplingParameters& p) {
  SamplingParams s;
  s.do_sample = p.do_sample();
  s.temperature = p.temperature() > 0 ? p.temperature() : 1.0f;
  s.top_k = static_cast<int>(p.top_k());
  s.top_p = p.top_p() > 0 ? p.top_p() : 1.0f;
  s.typical_p = p.typical_p() > 0 ? p.typical_p() : 1.0f;
  s.seed = p.seed();
  s.repetition_penalty = p.repetition_penalty() > 0 ? p.repetition_penalty() : 1.0f;
  s.length_penalty_start = p.length_penalty().start_index();
  s.length_penalty_decay = p.length_penalty().decay_factor();
  s.min_new_tokens = p.min_new_tokens();
  return s;
}

void ToProto(const TokenInfo& t, pb::TokenDetail* d) {
  d->set_token_id(static_cast<uint32_t>(t.id));
  d->set_logprob(t.logprob);
  d->set_rank(t.rank);
  for (const TopToken& top : t.top) {
    auto* tt = d->add_top_tokens();
    tt->set_token_id(static_cast<uint32_t>(top.id));
    tt->set_logprob(top.logprob);
  }
}

template <typename Response>
void AddResults(const std::vector<StepOutput>& outs, const std::vector<SequenceError>& errors,
                Response* resp) {
  for (const StepOutput& o : outs) {
    auto* g = resp->add_generations();
    g->set_request_id(o.id);
    ToProto(o.token, g->mutable_token());
    for (const TokenInfo& t : o.input_tokens) ToProto(t, g->add_input_tokens());
  }
  for (const SequenceError& e : errors) {
    auto* pe = resp->add_errors();
    pe->set_request_id(e.id);
    pe->set_code(static_cast<int32_t>(e.status.code()));
    pe->set_message(std::string(e.status.message()));
  }
}

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ShardService::ShardService(ModelConfig config, std::unique_ptr<Model> model, ShardOptions options)
    : config_(std::move(config)), pending_model_(std::move(model)), options_(std::move(options)) {
  max_positions_ = pending_model_->spec().ServedPositions(config_.max_position_embeddings);
  encoder_decoder_ = pending_model_->encoder_decoder();
  can_preempt_ = KeysIndependentOfLength(*pending_model_);
  prefixes_ = std::make_unique<PrefixStore>(
      PrefixStoreOptions{.store_path = options_.prefix_store_path,
                         .cache_mb = options_.prompt_cache_mb,
                         .hidden = pending_model_->spec().EmbedDim(),
                         .max_length = max_positions_,
                         .dtype = pending_model_->act_dtype(),
                         .device = pending_model_->device(),
                         .encoder_decoder = pending_model_->encoder_decoder(),
                         .model = pending_model_.get()});
}

grpc::Status ShardService::ServiceDiscovery(grpc::ServerContext*,
                                            const pb::ServiceDiscoveryRequest*,
                                            pb::ServiceDiscoveryResponse* resp) {
  for (const std::string& u : options_.urls) resp->add_urls(u);
  return grpc::Status::OK;
}

grpc::Status ShardService::Info(grpc::ServerContext*, const pb::InfoRequest*,
                                pb::InfoResponse* resp) {
  resp->set_model_kind(encoder_decoder_ ? pb::ENCODER_DECODER : pb::DECODER_ONLY);
  resp->set_model_type(config_.model_type);
  for (int32_t e : config_.eos_token_ids) resp->add_eos_token_ids(static_cast<uint32_t>(e));
  resp->set_vocab_size(static_cast<uint32_t>(config_.vocab_size));
  resp->set_dtype(options_.dtype);
  resp->set_device(options_.device);
  resp->set_block_size(static_cast<uint32_t>(options_.block_size));
  resp->set_max_position_embeddings(static_cast<uint32_t>(max_positions_));
  if (config_.bos_token_id) resp->set_bos_token_id(static_cast<uint32_t>(*config_.bos_token_id));
  if (config_.pad_token_id) resp->set_pad_token_id(static_cast<uint32_t>(*config_.pad_token_id));
  resp->set_rank(static_cast<uint32_t>(options_.rank));
  resp->set_world_size(static_cast<uint32_t>(options_.world_size));
  resp->set_can_preempt(can_preempt_);
  return grpc::Status::OK;
}

grpc::Status ShardService::Health(grpc::ServerContext*, const pb::HealthRequest*,
                                  pb::HealthResponse*) {
  return grpc::Status::OK;
}

grpc::Status ShardService::EnsureEngine() {
  if (engine_) return grpc::Status::OK;
  if (!pending_model_) return grpc::Status(grpc::StatusCode::INTERNAL, "no model loaded");
  // TGIS's BATCH_SAFETY_MARGIN: a share of the free memory that nothing is sized to use.
  double usable = static_cast<double>(
                      AvailableMemory(pending_model_->device(), options_.process_memory_fraction)) *
                  (1.0 - options_.batch_safety_margin / 100.0);
  // Recurrent states (Mamba-2 layers) are one fixed slot per live sequence: those of the most
  // sequences a step may hold come out of the memory first, so that neither the KV cache nor a
  // prefill counts on it (Granite 4.0-H-Small: ~150 MB a sequence in f32). Too many are refused
  // after the ranks' agreement below, so that every rank takes part in it.
  grpc::Status states_fit = grpc::Status::OK;
  const size_t per_sequence = RecurrentStateBytes(pending_model_->spec());
  if (per_sequence > 0) {
    const double states = static_cast<double>(per_sequence) * static_cast<double>(max_sequences_);
    const auto mib = [](double bytes) { return absl::StrFormat("%.1f MiB", bytes / (1 << 20)); };
    if (states >= usable) {
      states_fit = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("the recurrent (Mamba-2) states of ", max_sequences_, " sequences (",
                       mib(static_cast<double>(per_sequence)),
                       " each; the router's --max-batch-size, MAX_BATCH_SIZE) need ", mib(states),
                       ", more than the ", mib(usable), " available: lower MAX_BATCH_SIZE"));
      usable = 0;
    } else {
      usable -= states;
      LOG(INFO) << "recurrent states: " << max_sequences_ << " sequences of "
                << mib(static_cast<double>(per_sequence)) << ", " << mib(states)
                << " set aside before the KV cache";
    }
  }
  // A rank whose states do not fit offers no blocks, so that every rank fails with it.
  int64_t blocks = options_.num_blocks;
  if (!states_fit.ok()) {
    blocks = 0;
  } else if (blocks <= 0) {
    const size_t per_block = pending_model_->KvBytesPerToken() * options_.block_size;
    const uint64_t budget = static_cast<uint64_t>(usable * options_.memory_fraction);
    blocks = static_cast<int64_t>(std::min<uint64_t>(budget / per_block, 1u << 20));
  }
  // What is not for the KV cache carries a prefill's activations: the prefill weight limit.
  const double per_token = static_cast<double>(PrefillBytesPerToken(*pending_model_));
  max_prefill_tokens_ = static_cast<uint32_t>(std::min<double>(
      usable * (1.0 - options_.memory_fraction) / per_token, std::numeric_limits<uint32_t>::max()));
  // Tensor-parallel shards run every step together, so they must have the same blocks and the
  // same prefill limit (which sets the engine's step limit: one rank refusing what another runs
  // would part their collectives): the least of them. Every shard gets this call (the first
  // Warmup, Prefill or Decode), so every one takes part.
  int64_t agreed[2] = {blocks, static_cast<int64_t>(max_prefill_tokens_)};
  pending_model_->communicator().AllReduceMin(std::span<int64_t>(agreed, 2));
  blocks = agreed[0];
  max_prefill_tokens_ = static_cast<uint32_t>(agreed[1]);
  if (!states_fit.ok()) return states_fit;
  if (blocks <= 0) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "not enough memory for a single KV cache block");
  }
  const size_t block_bytes = pending_model_->KvBytesPerToken() * options_.block_size;
  LOG(INFO) << "KV cache: " << blocks << " blocks of " << options_.block_size << " tokens, "
            << kernels::DTypeName(pending_model_->kv_dtype()) << ", "
            << absl::StrFormat("%.1f", static_cast<double>(blocks) * block_bytes / (1 << 20))
            << " MiB";
  engine_ = std::make_unique<Engine>(std::move(pending_model_), config_.eos_token_ids,
                                     config_.max_position_embeddings, static_cast<int>(blocks),
                                     options_.block_size, options_.prefix_caching);
  if (options_.decode_ahead) ahead_ = std::make_unique<StepAhead>(&mu_, engine_.get());
  return grpc::Status::OK;
}

grpc::Status ShardService::EngineForCall() {
  if (auto st = EnsureEngine(); !st.ok()) return st;
  // Every call sees the engine as the steps answered so far left it, plus the one scheduled
  // after the last answer: run it here if the worker has not (the same on every shard).
  if (ahead_) ahead_->RunScheduled();
  return grpc::Status::OK;
}

grpc::Status ShardService::PrefixLookup(grpc::ServerContext*, const pb::PrefixLookupRequest* req,
                                        pb::PrefixLookupResponse* resp) {
  // Not under mu_: loading a prefix does not wait for a step, nor hold one up.
  auto prefix = prefixes_->Get(req->prefix_id());
  if (!prefix.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(prefix.status().code()),
                        std::string(prefix.status().message()));
  }
  resp->set_prefix_length(static_cast<uint32_t>(prefix->length(encoder_decoder_)));
  return grpc::Status::OK;
}

grpc::Status ShardService::Warmup(grpc::ServerContext*, const pb::WarmupRequest* req,
                                  pb::WarmupResponse* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!engine_) max_sequences_ = std::max<int64_t>(1, req->max_batch_size());
  if (!engine_ && req->max_batch_total_tokens() > 0 && options_.num_blocks <= 0) {
    options_.num_blocks = static_cast<int>(
        (req->max_batch_total_tokens() + options_.block_size - 1) / options_.block_size);
  }
  if (auto st = EngineForCall(); !st.ok()) return st;
  if (req->token_bytes_size() > 0) {
    guided_.SetVocabulary(std::make_shared<const GuidedVocabulary>(
        TokenBytesTable(req->token_bytes().begin(), req->token_bytes().end())));
  }
  // The largest step the router will send: a prefill of its prefill limit (which it raises to
  // one request of the longest length) beside a decode row for every other request. The engine
  // refuses anything larger, so no step needs more memory than this.
  const int64_t max_input = std::max<uint32_t>(1, req->max_input_length());
  const int64_t step_limit = std::max<int64_t>(max_prefill_tokens_, max_input) +
                             std::max<uint32_t>(1, req->max_batch_size());
  engine_->set_max_step_tokens(static_cast<size_t>(step_limit));
  // One real forward pass proves the model runs before the router admits traffic. On CUDA it
  // is the largest prefill those limits allow (as TGIS sizes memory): the stream-ordered pool
  // keeps what it took, so later steps find their memory there and never ask the driver for
  // more mid-traffic (an out-of-memory then would abort the shard; at start it names itself).
  // On the CPU a short prompt proves the model (host memory has no pool to fill).
  const bool cuda = engine_->model().device() == kernels::Device::kCuda;
  int64_t total = cuda ? step_limit : std::min<int64_t>(max_input, 64);
  total = std::min<int64_t>(total,
                            static_cast<int64_t>(engine_->free_blocks()) * engine_->block_size());
  const int64_t per_probe =
      max_positions_ > 0 ? std::min<int64_t>(max_input, max_positions_) : max_input;
  const int64_t vocab = engine_->model().spec().vocab;
  std::vector<NewSequence> probes;
  for (int64_t left = total; left > 0 && per_probe > 0; left -= per_probe) {
    NewSequence probe;
    probe.id = std::numeric_limits<uint64_t>::max() - probes.size();
    // Distinct first tokens: prefix caching must not let one probe reuse another's blocks.
    for (int64_t i = 0; i < std::min(left, per_probe); ++i) {
      probe.input_ids.push_back(static_cast<int32_t>((static_cast<int64_t>(probes.size()) + i) %
                                                     std::max<int64_t>(1, vocab)));
    }
    probes.push_back(std::move(probe));
  }
  if (!probes.empty()) {
    std::vector<uint64_t> ids;
    for (const NewSequence& p : probes) ids.push_back(p.id);
    std::vector<StepOutput> outs;
    std::vector<SequenceError> errors;
    engine_->Prefill(std::move(probes), &outs, &errors);
    for (uint64_t id : ids) engine_->Release(id);
    if (!errors.empty()) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("warmup failed: ", errors[0].status.message()));
    }
  }
  // Decode graphs are captured now, every bucket, before traffic can race a capture.
  // The CPU has no graphs: the flag (on by default) means nothing there.
  if (options_.cuda_graphs && engine_->model().device() == kernels::Device::kCuda &&
      !engine_->EnableDecodeGraphs(std::max<int64_t>(1, req->max_batch_size()))) {
    LOG(INFO)
        << "--cuda-graphs (CUDA_GRAPHS): this model runs every step eagerly (graphs "
           "need a decoder-only model, one shard, length-independent rotary and no mixture of "
           "experts)";
  }
  resp->set_num_blocks(static_cast<uint32_t>(engine_->num_blocks()));
  resp->set_block_size(static_cast<uint32_t>(engine_->block_size()));
  resp->set_max_supported_total_tokens(
      static_cast<uint32_t>(engine_->num_blocks() * engine_->block_size()));
  resp->set_max_prefill_tokens(max_prefill_tokens_);
  return grpc::Status::OK;
}

void ShardService::Release(uint64_t id) {
  if (ahead_) ahead_->Drop(id);
  engine_->Release(id);
}

pb::CachedBatch ShardService::Describe(uint64_t batch_id) {
  pb::CachedBatch b;
  b.set_id(batch_id);
  uint32_t total = 0;
  for (uint64_t id : batches_[batch_id]) {
    b.add_request_ids(id);
    // As the router knows it: a token stepped ahead is not its yet.
    const bool ahead = ahead_ && ahead_->Pending(id);
    total += static_cast<uint32_t>(engine_->CachedTokens(id) + (ahead ? 0 : 1));
  }
  b.set_size(static_cast<uint32_t>(batches_[batch_id].size()));
  b.set_total_tokens(total);
  return b;
}

namespace {

// The shard's span of a step: a child of the router's step span when the request names it.
tracing::Span StepSpan(const char* name, const std::string& traceparent, int rank) {
  if (!tracing::TracingEnabled()) return tracing::Span();
  const std::optional<tracing::SpanContext> parent =
      tracing::SpanContext::FromTraceparent(traceparent);
  tracing::Span span =
      tracing::StartSpan(name, parent ? &*parent : nullptr, tracing::SpanKind::kServer);
  span.SetAttribute("shard.rank", static_cast<int64_t>(rank));
  return span;
}

}  // namespace

grpc::Status ShardService::Prefill(grpc::ServerContext*, const pb::PrefillRequest* req,
                                   pb::PrefillResponse* resp) {
  const uint64_t t0 = NowNs();
  tracing::Span span = StepSpan("shard.prefill", req->traceparent(), options_.rank);
  span.SetAttribute("batch.requests", static_cast<int64_t>(req->batch().requests_size()));
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = EngineForCall(); !st.ok()) return st;
  const pb::Batch& batch = req->batch();
  if (batches_.count(batch.id())) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("batch ", batch.id(), " already exists"));
  }
  std::vector<NewSequence> news;
  std::vector<SequenceError> errors;
  for (const pb::Request& r : batch.requests()) {
    NewSequence n;
    if (r.resume()) {
      n.id = r.id();
      n.resume = true;
      news.push_back(std::move(n));
      continue;
    }
    if (!r.prefix_id().empty()) {
      auto prefix = prefixes_->Get(r.prefix_id());
      if (!prefix.ok()) {
        // TGIS's words; the cause goes to the log (the router looked the prefix up already,
        // so this is a prefix that changed or went away since).
        LOG(ERROR) << "Prefix lookup error for request #" << r.id() << ", prefix id "
                   << r.prefix_id() << ": " << prefix.status().message();
        errors.push_back({r.id(), absl::InvalidArgumentError(absl::StrCat(
                                      "Error retrieving prompt prefix '", r.prefix_id(), "'"))});
        continue;
      }
      n.prefix = prefix->decoder;
      n.encoder_prefix = prefix->encoder;
      n.lora = prefix->lora;
    }
    n.id = r.id();
    n.input_ids.assign(r.input_ids().begin(), r.input_ids().end());
    n.params = FromProto(r.parameters());
    n.max_new_tokens = r.max_new_tokens();
    n.top_n = r.top_n_tokens();
    n.input_logprobs = r.input_logprobs();
    n.speculate = r.speculate_tokens();
    if (r.has_guided()) {
      if (!guided_.has_vocabulary()) {
        errors.push_back({r.id(), absl::FailedPreconditionError(
                                      "guided decoding needs the vocabulary's bytes, which the "
                                      "router sends at warmup")});
        continue;
      }
      absl::Status bad;
      n.guided = guided_.Get(r.guided().SerializeAsString(),
                             [&]() -> std::shared_ptr<const grammar::ByteDfa> {
                               auto dfa = GuidedFromProto(r.guided());
                               if (!dfa.ok()) {
                                 bad = dfa.status();
                                 return nullptr;
                               }
                               return *std::move(dfa);
                             });
      if (n.guided == nullptr) {
        errors.push_back({r.id(), bad});
        continue;
      }
    }
    news.push_back(std::move(n));
  }
  std::vector<StepOutput> outs;
  std::vector<uint64_t> preempted, prefilling;
  engine_->Prefill(std::move(news), &outs, &errors, &preempted, req->max_prompt_tokens(),
                   &prefilling);
  AddResults(outs, errors, resp);
  resp->mutable_preempted_request_ids()->Add(preempted.begin(), preempted.end());
  resp->mutable_prefilling_request_ids()->Add(prefilling.begin(), prefilling.end());
  if (!outs.empty() || !prefilling.empty()) {
    auto& ids = batches_[batch.id()];
    for (const StepOutput& o : outs) ids.push_back(o.id);
    ids.insert(ids.end(), prefilling.begin(), prefilling.end());
    *resp->mutable_batch() = Describe(batch.id());
  }
  resp->set_forward_ns(engine_->last_forward_ns());
  resp->set_total_ns(NowNs() - t0);
  if (ahead_ && resp->has_batch()) {
    ahead_->Schedule({resp->batch().request_ids().begin(), resp->batch().request_ids().end()});
  }
  resp->set_prefix_cache_hits(engine_->last_reuse().sequences);
  resp->set_prefix_cache_reused_tokens(engine_->last_reuse().reused_tokens);
  span.SetAttribute("forward_ns", static_cast<int64_t>(resp->forward_ns()));
  span.SetAttribute("generations", static_cast<int64_t>(resp->generations_size()));
  return grpc::Status::OK;
}

grpc::Status ShardService::Decode(grpc::ServerContext*, const pb::DecodeRequest* req,
                                  pb::DecodeResponse* resp) {
  const uint64_t t0 = NowNs();
  tracing::Span span = StepSpan("shard.decode", req->traceparent(), options_.rank);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = EngineForCall(); !st.ok()) return st;
  if (req->batches_size() == 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no batches to decode");
  }
  for (const pb::CachedBatch& b : req->batches()) {
    if (!batches_.count(b.id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("batch ", b.id(), " not found"));
    }
  }
  const std::set<uint64_t> finished(req->finished_request_ids().begin(),
                                    req->finished_request_ids().end());
  // Merge the batches into the first one's id, dropping finished requests.
  const uint64_t merged_id = req->batches(0).id();
  std::vector<uint64_t> ids;
  std::vector<StepOutput> outs;
  std::vector<SequenceError> errors;
  for (const pb::CachedBatch& b : req->batches()) {
    for (uint64_t id : batches_[b.id()]) {
      if (finished.count(id)) {
        Release(id);
      } else if (!ahead_ || !ahead_->Take(id, &outs, &errors)) {
        ids.push_back(id);  // not stepped ahead: decoded now
      }
    }
    batches_.erase(b.id());
  }
  // Finished requests that were preempted are in no batch.
  for (uint64_t id : finished) {
    if (engine_->Preempted(id)) Release(id);
  }
  uint64_t forward_ns = ahead_ ? ahead_->TakeForwardNs() : 0;
  std::vector<uint64_t> preempted, prefilling;
  if (!ids.empty()) {
    engine_->Decode(ids, &outs, &errors, &preempted, req->max_prompt_tokens(), &prefilling);
    forward_ns += engine_->last_forward_ns();
  }
  AddResults(outs, errors, resp);
  resp->mutable_preempted_request_ids()->Add(preempted.begin(), preempted.end());
  resp->mutable_prefilling_request_ids()->Add(prefilling.begin(), prefilling.end());
  resp->set_draft_tokens(engine_->last_drafts().proposed);
  resp->set_accepted_draft_tokens(engine_->last_drafts().accepted);
  if (!preempted.empty()) {
    LOG(INFO) << "KV cache full: preempted " << preempted.size() << " request(s)";
  }
  if (!outs.empty() || !prefilling.empty()) {
    auto& kept = batches_[merged_id];
    // A speculating request may have several tokens in `outs`, in order: it is kept once.
    for (const StepOutput& o : outs) {
      if (kept.empty() || kept.back() != o.id) kept.push_back(o.id);
    }
    kept.insert(kept.end(), prefilling.begin(), prefilling.end());
    *resp->mutable_batch() = Describe(merged_id);
    if (ahead_) ahead_->Schedule(batches_[merged_id]);
  }
  resp->set_forward_ns(forward_ns);
  resp->set_total_ns(NowNs() - t0);
  span.SetAttribute("forward_ns", static_cast<int64_t>(resp->forward_ns()));
  span.SetAttribute("generations", static_cast<int64_t>(resp->generations_size()));
  return grpc::Status::OK;
}

grpc::Status ShardService::FilterBatch(grpc::ServerContext*, const pb::FilterBatchRequest* req,
                                       pb::FilterBatchResponse* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ahead_) ahead_->RunScheduled();
  auto it = batches_.find(req->batch_id());
  if (it == batches_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("batch ", req->batch_id(), " not found"));
  }
  const std::set<uint64_t> keep(req->request_ids().begin(), req->request_ids().end());
  std::vector<uint64_t> kept;
  for (uint64_t id : it->second) {
    if (keep.count(id)) {
      kept.push_back(id);
    } else {
      Release(id);
    }
  }
  it->second = std::move(kept);
  *resp->mutable_batch() = Describe(req->batch_id());
  if (it->second.empty()) batches_.erase(req->batch_id());
  return grpc::Status::OK;
}

grpc::Status ShardService::ClearCache(grpc::ServerContext*, const pb::ClearCacheRequest* req,
                                      pb::ClearCacheResponse*) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!engine_) return grpc::Status::OK;
  if (ahead_) ahead_->RunScheduled();
  if (req->has_id()) {
    auto it = batches_.find(req->id());
    if (it != batches_.end()) {
      for (uint64_t id : it->second) Release(id);
      batches_.erase(it);
    }
  } else {
    if (ahead_) ahead_->DropAll();
    engine_->ReleaseAll();
    batches_.clear();
  }
  return grpc::Status::OK;
}

}  // namespace tgis::server

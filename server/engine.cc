#include "server/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace tgis::server {

using kernels::DType;
using kernels::Tensor;

namespace {

// A step end that marks a sequence refused (RefuseBeyondStepLimit).
constexpr size_t kRefused = std::numeric_limits<size_t>::max();

// No NaN and no +inf (-inf is a banned token's logit).
bool AllFinite(const float* logits, int64_t n) {
  return std::none_of(logits, logits + n, [](float f) {
    return std::isnan(f) || f == std::numeric_limits<float>::infinity();
  });
}

// Largest logits a sampled row sends to the host (TopLogits) instead of its whole row: enough
// for the warpers and the draw to finish within them almost always (a walk that would go
// further reads the row).
constexpr int64_t kTopValues = 1024;
std::atomic<TopValues> g_top_values{TopValues::kOnGpu};

// The batch's shortest and longest query from its row offsets (CUDA attention launches only
// the kernels some sequence needs).
void NoteQueryLengths(const std::vector<int32_t>& query_start, kernels::AttentionBatch* b) {
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = 0;
  for (size_t i = 1; i < query_start.size(); ++i) {
    lo = std::min(lo, query_start[i] - query_start[i - 1]);
    hi = std::max(hi, query_start[i] - query_start[i - 1]);
  }
  if (hi == 0) return;  // no sequence, or none with a row: leave the hints unknown
  b->min_query_len = std::max(lo, 1);
  b->max_query_len = hi;
}

// Prompt details take their logits this many rows at a time: at most ~64 MB of f32 (128 rows of
// a 128K vocabulary), at least one row.
std::atomic<int64_t> g_detail_chunk_bytes{int64_t{64} << 20};
int32_t DetailRowsPerChunk(int64_t vocab) {
  return static_cast<int32_t>(std::max<int64_t>(1, g_detail_chunk_bytes.load() / (4 * vocab)));
}

// Prefix caching shares the keys and values a sequence computed with any later one that starts
// with the same tokens (and the same prompt-tuning prefix), and preemption computes a
// sequence's tokens again in one pass: both need a token's keys and values to be the same
// whenever and however they are computed. Not so for rotary scalings whose frequencies follow
// the sequence's length (dynamic NTK, LongRoPE: a key computed at one length is not the key
// another length computes), which leave both off. Encoder-decoder models leave prefix caching
// off too (the decoder's prompt is one start token; the encoder's output is per input).
bool PrefixCachingApplies(const Model& model) {
  // A recurrent layer's state after a prefix is not in the prefix's blocks.
  return !model.encoder_decoder() && KeysIndependentOfLength(model) &&
         model.spec().RecurrentStateShapes().empty();
}

}  // namespace

void SetDetailChunkBytesForTesting(int64_t bytes) { g_detail_chunk_bytes.store(bytes); }
void SetTopValuesForTesting(TopValues when) { g_top_values.store(when); }

bool KeysIndependentOfLength(const Model& model) {
  return !model.spec().rope_by_length.has_value();
}

Engine::Engine(std::unique_ptr<Model> model, std::vector<int32_t> eos_ids, int64_t max_positions,
               int num_blocks, int block_size, bool prefix_caching)
    : model_(std::move(model)), eos_(std::move(eos_ids)), max_positions_(max_positions) {
  prefix_caching_ = prefix_caching && PrefixCachingApplies(*model_);
  keys_independent_of_length_ = KeysIndependentOfLength(*model_);
  const DecoderSpec& s = model_->spec();
  state_shapes_ = s.RecurrentStateShapes();
  max_positions_ = s.ServedPositions(max_positions);
  // No limit of the model's own (ALiBi models without one in the config, relative positions):
  // the router's MAX_SEQUENCE_LENGTH is the limit.
  if (max_positions_ <= 0) max_positions_ = std::numeric_limits<int32_t>::max();
  // A tensor-parallel rank caches only its own KV heads.
  cache_ = std::make_unique<KvCache>(static_cast<int>(s.num_layers), num_blocks, block_size,
                                     static_cast<int>(model_->shard().kv_heads.size()),
                                     static_cast<int>(s.head_dim), model_->kv_dtype(),
                                     model_->device(), prefix_caching_, s.mamba_layers);
}

size_t Engine::CachedTokens(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second->cached;
}

bool Engine::AllocateBlocks(size_t n, std::vector<int32_t>* blocks) {
  std::vector<int32_t> got;
  while (got.size() < n) {
    auto b = cache_->blocks().Allocate();
    if (!b) {
      for (int32_t x : got) cache_->blocks().Release(x);
      return false;
    }
    got.push_back(*b);
  }
  blocks->insert(blocks->end(), got.begin(), got.end());
  return true;
}

size_t Engine::MissingBlocks(const Sequence& s) const {
  const size_t bs = static_cast<size_t>(cache_->block_size());
  const size_t need = (s.tokens.size() + bs - 1) / bs;
  return need > s.blocks.size() ? need - s.blocks.size() : 0;
}

bool Engine::Reserve(Sequence* s) {
  if (const size_t missing = MissingBlocks(*s);
      missing > 0 && !AllocateBlocks(missing, &s->blocks)) {
    return false;
  }
  const size_t bs = static_cast<size_t>(cache_->block_size());
  const size_t cross = (s->encoder_ids.size() + bs - 1) / bs;
  if (s->cross_blocks.size() < cross &&
      !AllocateBlocks(cross - s->cross_blocks.size(), &s->cross_blocks)) {
    return false;
  }
  return true;
}

void Engine::FreeBlocks(Sequence* s) {
  // Last to first: the cache evicts a prompt's later blocks before its first ones.
  for (auto b = s->blocks.rbegin(); b != s->blocks.rend(); ++b) cache_->blocks().Release(*b);
  for (int32_t b : s->cross_blocks) cache_->blocks().Release(b);
  s->blocks.clear();
  s->cross_blocks.clear();
  s->registered = 0;
}

void Engine::ReuseCachedPrefix(Sequence* s) {
  BlockCache& cache = cache_->blocks();
  // A LoRA adapter's keys and values are its own: its sequences share blocks among themselves.
  s->chain = cache.Root(s->lora ? std::shared_ptr<const void>(s->lora)
                                : std::shared_ptr<const void>(s->prefix));
  // Prompt logprobs need every prompt row's logits: such a prompt is computed whole (its
  // blocks are still registered for others).
  if (s->input_logprobs) return;
  // The last prompt token is always computed: its logits give the first new token.
  const size_t max_blocks = (s->tokens.size() - 1) / static_cast<size_t>(cache.block_size());
  s->blocks = cache.Match(s->chain, s->tokens, max_blocks, &s->chain);
  s->registered = s->blocks.size();
  s->cached = s->blocks.size() * static_cast<size_t>(cache.block_size());
}

void Engine::CountReuse(const Sequence& s) {
  if (s.cached == 0) return;
  last_reuse_.sequences += 1;
  last_reuse_.reused_tokens += s.cached;
}

void Engine::RegisterFullBlocks(Sequence* s) {
  if (s->chain == 0) return;
  BlockCache& cache = cache_->blocks();
  const size_t bs = static_cast<size_t>(cache.block_size());
  while ((s->registered + 1) * bs <= s->cached) {
    s->chain = cache.Register(s->chain,
                              std::span<const int32_t>(s->tokens).subspan(s->registered * bs, bs),
                              s->blocks[s->registered]);
    ++s->registered;
  }
}

void Engine::Release(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  FreeBlocks(it->second.get());
  ReleaseState(it->second.get());
  seqs_.erase(it);
}

void Engine::ReleaseAll() {
  for (auto& [id, s] : seqs_) {
    FreeBlocks(s.get());
    ReleaseState(s.get());
  }
  seqs_.clear();
}

namespace {
// Recurrent states stay f32 whatever the activations: the scan adds into them at every token.
constexpr kernels::DType kStateDType = kernels::DType::kF32;
}  // namespace

size_t RecurrentStateBytes(const DecoderSpec& spec) {
  size_t bytes = 0;
  for (const kernels::Shape& shape : spec.RecurrentStateShapes()) {
    size_t n = kernels::DTypeSize(kStateDType);
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    bytes += n;
  }
  return bytes;
}

void Engine::AcquireState(Sequence* s) {
  if (state_shapes_.empty() || s->state_slot >= 0) return;
  if (!free_states_.empty()) {
    s->state_slot = free_states_.back();
    free_states_.pop_back();
    return;
  }
  std::vector<kernels::Tensor> slot;
  for (const kernels::Shape& shape : state_shapes_) {
    slot.push_back(kernels::Tensor::Zeros(shape, kStateDType, model_->device()));
  }
  s->state_slot = static_cast<int32_t>(states_.size());
  states_.push_back(std::move(slot));
}

void Engine::ReleaseState(Sequence* s) {
  if (s->state_slot < 0) return;
  free_states_.push_back(s->state_slot);
  s->state_slot = -1;
}

void Engine::Prefill(std::vector<NewSequence> news, std::vector<StepOutput>* out,
                     std::vector<SequenceError>* errors, std::vector<uint64_t>* preempted,
                     size_t prompt_budget, std::vector<uint64_t>* prefilling) {
  const int64_t vocab = model_->spec().vocab;
  last_reuse_ = {};
  std::vector<Sequence*> batch;
  for (NewSequence& n : news) {
    auto fail = [&](absl::Status st) { errors->push_back({n.id, std::move(st)}); };
    if (n.resume) {
      auto it = seqs_.find(n.id);
      if (it == seqs_.end() || !it->second->preempted) {
        fail(absl::FailedPreconditionError(absl::StrCat("request ", n.id, " is not preempted")));
        continue;
      }
      Sequence* s = it->second.get();
      if (prefix_caching_) ReuseCachedPrefix(s);
      if (!Reserve(s)) {
        Preempt(s);
        if (preempted != nullptr) {
          preempted->push_back(n.id);
        } else {
          fail(absl::ResourceExhaustedError("not enough KV cache blocks to resume the request"));
          Release(n.id);
        }
        continue;
      }
      s->preempted = false;
      CountReuse(*s);
      batch.push_back(s);
      continue;
    }
    if (seqs_.count(n.id)) {
      fail(absl::AlreadyExistsError(absl::StrCat("request ", n.id, " is already running")));
      continue;
    }
    if (n.input_ids.empty()) {
      fail(absl::InvalidArgumentError("empty input"));
      continue;
    }
    bool bad_id = false;
    for (int32_t t : n.input_ids) bad_id = bad_id || t < 0 || t >= vocab;
    if (bad_id) {
      fail(
          absl::InvalidArgumentError(absl::StrCat("input token id out of range [0, ", vocab, ")")));
      continue;
    }
    const bool encoder_decoder = model_->encoder_decoder();
    const size_t virtual_tokens = n.prefix ? static_cast<size_t>(n.prefix->dim(0)) : 0;
    if (static_cast<int64_t>(virtual_tokens + n.input_ids.size() + n.max_new_tokens) >
        max_positions_) {
      fail(absl::InvalidArgumentError(absl::StrCat("input (", n.input_ids.size(), ") plus prefix (",
                                                   virtual_tokens, ") plus max_new_tokens (",
                                                   n.max_new_tokens, ") exceeds the model's ",
                                                   max_positions_, " positions")));
      continue;
    }
    auto s = std::make_unique<Sequence>();
    s->id = n.id;
    s->prefix = std::move(n.prefix);
    s->prefix_len = virtual_tokens;
    s->lora = std::move(n.lora);
    s->tokens.assign(virtual_tokens, 0);  // placeholders: their embeddings are the prefix's
    if (encoder_decoder) {
      // TGIS: the encoder prefix's vectors, then the input; the decoder prefix's, then the
      // decoder start token.
      s->encoder_prefix_len = n.encoder_prefix ? static_cast<size_t>(n.encoder_prefix->dim(0)) : 0;
      s->encoder_prefix = std::move(n.encoder_prefix);
      s->encoder_ids.assign(s->encoder_prefix_len, 0);
      s->encoder_ids.insert(s->encoder_ids.end(), n.input_ids.begin(), n.input_ids.end());
      s->tokens.push_back(model_->decoder_start_token());
    } else {
      s->tokens.insert(s->tokens.end(), n.input_ids.begin(), n.input_ids.end());
    }
    s->prompt_len = s->tokens.size();
    s->order = next_order_++;
    s->sampler = std::make_unique<Sampler>(n.params, eos_);
    s->top_n = n.top_n;
    s->input_logprobs = n.input_logprobs;
    s->max_new = n.max_new_tokens;
    s->speculate = n.speculate;
    if (n.guided != nullptr) {
      if (eos_.empty()) {
        fail(absl::FailedPreconditionError(
            "guided decoding needs the model's EOS token to end the text"));
        continue;
      }
      s->sampler->SetConstraint(std::make_unique<TokenConstraint>(n.guided, eos_));
      s->speculate = 0;  // drafts would bypass the constraint
    }
    if (prefix_caching_) ReuseCachedPrefix(s.get());
    if (!Reserve(s.get())) {
      FreeBlocks(s.get());
      fail(absl::ResourceExhaustedError("not enough KV cache blocks for the prompt"));
      continue;
    }
    CountReuse(*s);
    if (!state_shapes_.empty()) {
      // Rejected draft tokens would have advanced the recurrent states.
      s->speculate = 0;
      AcquireState(s.get());
    }
    batch.push_back(s.get());
    seqs_[n.id] = std::move(s);
  }
  if (!batch.empty()) RunStep(batch, /*prefill=*/true, prompt_budget, out, errors, prefilling);
}

bool Engine::EnableDecodeGraphs(int64_t capture_batch) {
  if (!DecodeGraphs::Supports(*model_)) return false;
  if (graphs_ == nullptr) graphs_ = std::make_unique<DecodeGraphs>(cache_->block_size());
  if (capture_batch > 0) {
    const int64_t bs = cache_->block_size();
    const int64_t tokens =
        std::min<int64_t>(max_positions_ > 0 ? max_positions_ : INT32_MAX, num_blocks() * bs);
    const int captured = graphs_->CaptureAll(*model_, cache_->layers(), capture_batch,
                                             std::max<int64_t>(1, (tokens + bs - 1) / bs));
    LOG(INFO) << "decode graphs: " << captured << " of " << graphs_->graphs()
              << " buckets captured, " << (graphs_->MemoryBytes() >> 20) << " MiB of graph memory";
  }
  return true;
}

void Engine::Decode(const std::vector<uint64_t>& ids, std::vector<StepOutput>* out,
                    std::vector<SequenceError>* errors, std::vector<uint64_t>* preempted,
                    size_t prompt_budget, std::vector<uint64_t>* prefilling) {
  std::vector<Sequence*> batch;
  std::set<uint64_t> seen;
  for (uint64_t id : ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) {
      errors->push_back({id, absl::NotFoundError(absl::StrCat("request ", id, " is not cached"))});
      continue;
    }
    if (!seen.insert(id).second) {  // one step, one place in it
      errors->push_back(
          {id, absl::InvalidArgumentError(absl::StrCat("request ", id, " is listed twice"))});
      continue;
    }
    Sequence* s = it->second.get();
    if (s->preempted) {
      errors->push_back({id, absl::FailedPreconditionError(absl::StrCat(
                                 "request ", id, " is preempted: resume it with a prefill"))});
      continue;
    }
    if (static_cast<int64_t>(s->tokens.size()) >= max_positions_) {
      errors->push_back({id, absl::OutOfRangeError("the model's positions are exhausted")});
      Release(id);
      continue;
    }
    batch.push_back(s);
  }
  batch = ReserveOrPreempt(batch, errors, keys_independent_of_length_ ? preempted : nullptr);
  last_drafts_ = {};
  AddDrafts(batch);
  if (!batch.empty()) RunStep(batch, /*prefill=*/false, prompt_budget, out, errors, prefilling);
}

std::vector<uint64_t> Engine::DecodableAhead(const std::vector<uint64_t>& ids) {
  std::vector<uint64_t> ahead;
  size_t blocks = 0;
  for (uint64_t id : ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) continue;
    const Sequence& s = *it->second;
    if (s.preempted || s.speculate > 0 || s.cached + 1 != s.tokens.size()) continue;
    if (s.generated >= s.max_new || static_cast<int64_t>(s.tokens.size()) >= max_positions_) {
      continue;
    }
    if (std::find(eos_.begin(), eos_.end(), s.tokens.back()) != eos_.end()) continue;
    blocks += MissingBlocks(s);  // what Reserve will take for the step
    ahead.push_back(id);
  }
  if (blocks > static_cast<size_t>(std::max(0, free_blocks()))) return {};
  return ahead;
}

std::vector<int32_t> Engine::ProposeDraft(const Sequence& s, size_t limit) const {
  // Only real tokens (not prompt-tuning placeholders) are looked up.
  const std::span<const int32_t> t = std::span<const int32_t>(s.tokens).subspan(s.prefix_len);
  for (size_t n = std::min<size_t>(3, t.size() - 1); n >= 1; --n) {
    const std::span<const int32_t> tail = t.subspan(t.size() - n);
    // The latest earlier occurrence: its continuation is the likeliest to repeat.
    for (size_t j = t.size() - n; j-- > 0;) {
      if (std::equal(tail.begin(), tail.end(), t.begin() + static_cast<std::ptrdiff_t>(j))) {
        const size_t from = j + n, to = std::min(t.size(), from + limit);
        return std::vector<int32_t>(t.begin() + static_cast<std::ptrdiff_t>(from),
                                    t.begin() + static_cast<std::ptrdiff_t>(to));
      }
    }
  }
  return {};
}

void Engine::AddDrafts(const std::vector<Sequence*>& seqs) {
  // A draft's keys are computed at the length the step reaches, which length-dependent rotary
  // would rotate differently from step-by-step decoding.
  if (!keys_independent_of_length_) return;
  // Drafts are extra rows: with every sequence's tokens still to compute (a prompt's whole rest,
  // on the safe side of its chunk) they stay within the step limit, never crowding a prompt out.
  int64_t step_room = std::numeric_limits<int64_t>::max();
  if (max_step_tokens_ > 0) {
    step_room = static_cast<int64_t>(max_step_tokens_);
    for (const Sequence* s : seqs) step_room -= static_cast<int64_t>(s->tokens.size() - s->cached);
  }
  for (Sequence* s : seqs) {
    s->draft.clear();
    // Decoding greedy sequences only (a prompt still being computed has no next token yet),
    // never past max_new_tokens or the model's positions.
    if (s->speculate == 0 || s->cached + 1 != s->tokens.size() || s->tokens.size() < 2) continue;
    const int64_t room = std::min<int64_t>(
        {static_cast<int64_t>(s->max_new) - static_cast<int64_t>(s->generated) - 1,
         max_positions_ - static_cast<int64_t>(s->tokens.size()) - 1, step_room});
    if (room <= 0) continue;
    s->draft = ProposeDraft(*s, std::min<size_t>(s->speculate, static_cast<size_t>(room)));
    if (s->draft.empty()) continue;
    const size_t blocks_before = s->blocks.size();
    s->tokens.insert(s->tokens.end(), s->draft.begin(), s->draft.end());
    if (!Reserve(s)) {  // no room for the draft: decode plainly
      s->tokens.resize(s->tokens.size() - s->draft.size());
      s->draft.clear();
      while (s->blocks.size() > blocks_before) {
        cache_->blocks().Release(s->blocks.back());
        s->blocks.pop_back();
      }
      continue;
    }
    last_drafts_.proposed += static_cast<uint32_t>(s->draft.size());
    step_room -= static_cast<int64_t>(s->draft.size());
  }
}

void Engine::VerifyDraft(Sequence* s, const float* rows, int64_t vocab,
                         std::vector<StepOutput>* out) {
  const std::vector<int32_t> draft = std::move(s->draft);
  s->draft.clear();
  s->tokens.resize(s->tokens.size() - draft.size());
  for (size_t j = 0; j <= draft.size(); ++j) {
    std::vector<float> row(rows + j * vocab, rows + (j + 1) * vocab);
    // Sampling accepts draft[j] with its probability (else draws another token): the token's
    // distribution is what decoding without a draft has. Greedy compares below.
    const std::optional<int32_t> proposed =
        j < draft.size() ? std::optional<int32_t>(draft[j]) : std::nullopt;
    TokenChoice c =
        s->sampler->Next(row, std::span<const int32_t>(s->tokens).subspan(s->prefix_len),
                         s->generated, s->top_n, proposed);
    StepOutput o;
    o.id = s->id;
    o.token.id = c.id;
    o.token.logprob = c.logprob;
    o.token.rank = c.rank;
    o.token.top = std::move(c.top);
    // Row j + 1 was computed after draft[j]: it is this sequence's only while they agree.
    Advance(s, c.id);
    out->push_back(std::move(o));
    if (j == draft.size() || c.id != draft[j]) break;
    last_drafts_.accepted += 1;
  }
}

void Engine::Preempt(Sequence* s) {
  FreeBlocks(s);
  s->cached = 0;
  s->chain = 0;
  s->preempted = true;
  // Its prompt details went out with its first token.
  s->input_logprobs = false;
}

std::vector<Engine::Sequence*> Engine::ReserveOrPreempt(const std::vector<Sequence*>& seqs,
                                                        std::vector<SequenceError>* errors,
                                                        std::vector<uint64_t>* preempted) {
  std::vector<Sequence*> by_age = seqs;
  std::sort(by_age.begin(), by_age.end(),
            [](const Sequence* a, const Sequence* b) { return a->order < b->order; });
  std::vector<uint64_t> dropped;
  for (size_t i = 0; i < by_age.size();) {
    Sequence* s = by_age[i];
    if (Reserve(s)) {
      ++i;
      continue;
    }
    if (preempted == nullptr || by_age.size() == 1) {
      // Alone it still does not fit (or preemption is not wanted): it can never run.
      errors->push_back({s->id, absl::ResourceExhaustedError("out of KV cache blocks")});
      dropped.push_back(s->id);
      FreeBlocks(s);
      by_age.erase(by_age.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    // The newest gives its blocks up (possibly s itself); s then tries again.
    Sequence* victim = by_age.back();
    Preempt(victim);
    preempted->push_back(victim->id);
    by_age.pop_back();
  }
  std::vector<Sequence*> kept;
  for (Sequence* s : seqs) {
    if (std::find(by_age.begin(), by_age.end(), s) != by_age.end()) kept.push_back(s);
  }
  for (uint64_t id : dropped) Release(id);
  return kept;
}

std::vector<size_t> Engine::OldestFirst(const std::vector<Sequence*>& seqs) {
  std::vector<size_t> by_age(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) by_age[i] = i;
  std::sort(by_age.begin(), by_age.end(),
            [&](size_t a, size_t b) { return seqs[a]->order < seqs[b]->order; });
  return by_age;
}

bool Engine::RefuseBeyondStepLimit(const std::vector<Sequence*>& seqs, std::vector<size_t>* ends,
                                   std::vector<SequenceError>* errors) {
  if (max_step_tokens_ == 0) return false;
  size_t total = 0;
  for (size_t i = 0; i < seqs.size(); ++i) total += (*ends)[i] - seqs[i]->cached;
  if (total <= max_step_tokens_) return false;  // the usual case: no order to work out
  // The oldest sequences keep their places; the newer ones that would take the step past what
  // the shard's memory was sized for are refused.
  total = 0;
  for (size_t i : OldestFirst(seqs)) {
    const size_t tokens = (*ends)[i] - seqs[i]->cached;
    if (total + tokens <= max_step_tokens_ || tokens == 0) {
      total += tokens;
      continue;
    }
    errors->push_back(
        {seqs[i]->id, absl::ResourceExhaustedError(absl::StrCat(
                          "this step would compute ", total + tokens, " tokens, more than the ",
                          max_step_tokens_, " this shard's memory was sized for at warmup"))});
    Release(seqs[i]->id);
    (*ends)[i] = kRefused;
  }
  return true;
}

bool Engine::Chunkable(const Sequence& s) const {
  // Prompt logprobs need every prompt row's logits in one pass; an encoder-decoder model's
  // prompt is its encoder's; length-dependent rotary computes a chunk's keys at its length.
  return !s.input_logprobs && !model_->encoder_decoder() && keys_independent_of_length_ &&
         s.draft.empty();
}

void Engine::RunStep(const std::vector<Sequence*>& seqs, bool prefill, size_t prompt_budget,
                     std::vector<StepOutput>* out, std::vector<SequenceError>* errors,
                     std::vector<uint64_t>* prefilling) {
  if (prompt_budget == 0 || prefilling == nullptr) {
    std::vector<size_t> ends;
    for (const Sequence* s : seqs) ends.push_back(s->tokens.size());
    if (!RefuseBeyondStepLimit(seqs, &ends, errors)) {
      Run(seqs, ends, prefill, out, errors);
      return;
    }
    std::vector<Sequence*> step;
    std::vector<size_t> step_ends;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (ends[i] == kRefused) continue;
      step.push_back(seqs[i]);
      step_ends.push_back(ends[i]);
    }
    if (!step.empty()) Run(step, step_ends, prefill, out, errors);
    return;
  }
  // The budget goes to the oldest sequences first; a decode row (one token) is never held up.
  const std::vector<size_t> by_age = OldestFirst(seqs);
  std::vector<size_t> end_of(seqs.size());
  // Prompt chunks share the budget, which never exceeds the step limit (PREFILL_CHUNK_TOKENS
  // above what warmup sized is cut to it, not refused).
  size_t left = max_step_tokens_ > 0 ? std::min(prompt_budget, max_step_tokens_) : prompt_budget;
  for (size_t i : by_age) {
    const Sequence* s = seqs[i];
    const size_t remaining = s->tokens.size() - s->cached;
    if (remaining <= 1 || !Chunkable(*s)) {
      end_of[i] = s->tokens.size();
    } else {
      end_of[i] = s->cached + std::min(remaining, left);
      left -= end_of[i] - s->cached;
    }
  }
  RefuseBeyondStepLimit(seqs, &end_of, errors);
  std::vector<Sequence*> step;
  std::vector<size_t> ends;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (end_of[i] == kRefused) continue;
    // Short of its last token: no new token this step (even when one prompt token is left).
    if (end_of[i] < seqs[i]->tokens.size()) prefilling->push_back(seqs[i]->id);
    if (end_of[i] > seqs[i]->cached) {
      step.push_back(seqs[i]);
      ends.push_back(end_of[i]);
    }
  }
  if (!step.empty()) Run(step, ends, prefill, out, errors);
}

void Engine::Run(const std::vector<Sequence*>& seqs, const std::vector<size_t>& ends, bool prefill,
                 std::vector<StepOutput>* out, std::vector<SequenceError>* errors) {
  const int bs = cache_->block_size();
  std::vector<int32_t> ids, positions, slots, query_start{0}, context_lens;
  size_t max_blocks = 0;
  for (Sequence* s : seqs) max_blocks = std::max(max_blocks, s->blocks.size());
  std::vector<int32_t> tables(seqs.size() * std::max<size_t>(max_blocks, 1), 0);
  std::vector<int32_t> logit_rows;   // the rows a token is chosen from (or a draft verified)
  std::vector<int32_t> detail_rows;  // the rows whose logits give prompt details
  // For each sequence: its rows of the logits, in order, and of the details.
  std::vector<std::pair<int32_t, int32_t>> seq_rows;     // [first logit row, count]
  std::vector<std::pair<int32_t, int32_t>> detail_span;  // [first detail row, count]
  std::vector<bool> details;                             // prompt details requested
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence* s = seqs[i];
    const size_t begin = s->cached, end = ends[i];
    const bool complete = end == s->tokens.size();  // else a prompt chunk: no logits
    const int32_t row0 = static_cast<int32_t>(ids.size());
    for (size_t p = begin; p < end; ++p) {
      ids.push_back(s->tokens[p]);
      positions.push_back(static_cast<int32_t>(p));
      slots.push_back(s->blocks[p / bs] * bs + static_cast<int32_t>(p % bs));
    }
    query_start.push_back(static_cast<int32_t>(ids.size()));
    context_lens.push_back(static_cast<int32_t>(end));
    std::copy(s->blocks.begin(), s->blocks.end(),
              tables.begin() + i * std::max<size_t>(max_blocks, 1));
    const int32_t n = static_cast<int32_t>(end - begin);
    detail_span.emplace_back(static_cast<int32_t>(detail_rows.size()), 0);
    if (!complete) {
      seq_rows.emplace_back(static_cast<int32_t>(logit_rows.size()), 0);
      details.push_back(false);
      continue;
    }
    // A draft is verified on every row; the next token comes from the last row.
    const int32_t rows = s->draft.empty() ? 1 : n;
    seq_rows.emplace_back(static_cast<int32_t>(logit_rows.size()), rows);
    for (int32_t r = n - rows; r < n; ++r) logit_rows.push_back(row0 + r);
    details.push_back(prefill && s->input_logprobs);
    // Prompt logprobs of tokens p in [max(prefix_len, 1), n) come from rows p - 1 (decoder-only
    // models; an encoder-decoder model's input tokens have none).
    if (details.back() && !model_->encoder_decoder()) {
      const int32_t first = std::max<int32_t>(static_cast<int32_t>(s->prefix_len), 1) - 1;
      detail_span.back().second = std::max<int32_t>(0, n - 1 - first);
      for (int32_t r = first; r < n - 1; ++r) detail_rows.push_back(row0 + r);
    }
  }
  const int64_t t = static_cast<int64_t>(ids.size());
  const int64_t nseq = static_cast<int64_t>(seqs.size());
  const int64_t table_cols = static_cast<int64_t>(std::max<size_t>(max_blocks, 1));
  // A step's logits rows: the choosing rows first, then the detail rows, whose logits are made
  // a chunk at a time below (a long prompt's [prompt, vocabulary] f32 logits at once would be
  // gigabytes). A step of prompt chunks only still asks for one row (unused): no op sees zero
  // rows.
  const bool one_row_each =
      !prefill && t == nseq && detail_rows.empty() &&
      static_cast<int64_t>(logit_rows.size()) == nseq &&
      std::all_of(seqs.begin(), seqs.end(), [](const Sequence* s) {
        return s->cached >= s->prefix_len;  // no virtual token (prompt tuning)
      });
  if (logit_rows.empty()) logit_rows.push_back(static_cast<int32_t>(t - 1));
  const int64_t choosing = static_cast<int64_t>(logit_rows.size());
  const auto t0 = std::chrono::steady_clock::now();
  Tensor hidden, logits;
  // A plain decode step (one new token and one logits row per sequence) replays its bucket's
  // captured graph where the model allows it.
  // (Graphs capture the base model alone: a step with a LoRA adapter runs eagerly.)
  const bool any_lora =
      std::any_of(seqs.begin(), seqs.end(), [](const Sequence* s) { return s->lora != nullptr; });
  if (graphs_ != nullptr && one_row_each && !any_lora) {
    logits = graphs_->Step(*model_, cache_->layers(), ids, positions, slots, context_lens, tables,
                           table_cols);
  }
  if (!logits.defined()) {
    // The step's index tensors travel to the model's device as one buffer (one copy, not six)
    // and are views into it.
    std::vector<int32_t> meta;
    meta.reserve(3 * t + 2 * nseq + 1 + tables.size());
    std::vector<int64_t> at;  // where each part starts
    for (const std::vector<int32_t>* part :
         {&ids, &positions, &slots, &query_start, &context_lens, &tables}) {
      at.push_back(static_cast<int64_t>(meta.size()));
      meta.insert(meta.end(), part->begin(), part->end());
    }
    Tensor all = Tensor::FromVector(meta, {static_cast<int64_t>(meta.size())});
    if (model_->device() != kernels::Device::kCpu) all = all.ToDevice(model_->device());
    ForwardInput in;
    in.input_ids = all.Rows(at[0], at[0] + t);
    in.positions = all.Rows(at[1], at[1] + t);
    in.slot_mapping = all.Rows(at[2], at[2] + t);
    in.attn.query_start = all.Rows(at[3], at[3] + nseq + 1);
    in.attn.context_lens = all.Rows(at[4], at[4] + nseq);
    in.attn.block_tables = all.Rows(at[5], at[5] + nseq * table_cols).Reshape({nseq, table_cols});
    in.attn.block_size = bs;
    in.attn.max_context_len = *std::max_element(context_lens.begin(), context_lens.end());
    NoteQueryLengths(query_start, &in.attn);
    in.host_query_start = std::move(query_start);
    in.host_context_lens = std::move(context_lens);
    if (model_->encoder_decoder()) {
      if (prefill) Encode(seqs);
      in.cross_attn = CrossBatch(seqs, in.host_query_start, /*causal=*/false);
    }
    std::vector<PrefixSpan> spans;
    for (size_t i = 0; i < seqs.size(); ++i) {
      spans.push_back({seqs[i]->prefix.get(), seqs[i]->prefix_len, seqs[i]->cached, ends[i]});
    }
    AddPrefixRows(spans, &in);
    if (any_lora) AddLoraRows(seqs, in.host_query_start, &in);
    if (!state_shapes_.empty()) {
      for (Sequence* s : seqs) {
        in.recurrent.push_back(&states_[static_cast<size_t>(s->state_slot)]);
        in.recurrent_fresh.push_back(s->cached == 0 ? 1 : 0);
      }
    }
    std::vector<int32_t> hidden_rows = logit_rows;
    hidden_rows.insert(hidden_rows.end(), detail_rows.begin(), detail_rows.end());
    hidden = model_->ForwardHidden(in, cache_->layers(), hidden_rows);
    logits = model_->Logits(hidden.Rows(0, choosing));
  }
  // Plain greedy rows pick where the logits are (on CUDA only their ids and logprobs come
  // back), sampled ones mostly choose from their largest values; the other sequences' rows are
  // read on the host.
  DevicePicks picks = PickOnDevice(seqs, details, seq_rows, &logits);
  std::vector<std::optional<TokenInfo>>& picked = picks.greedy;
  last_forward_ns_ =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  const int64_t v = logits.dim(1);
  // A NaN or +inf in a sequence's logits (its activations overflowed, or a prompt-tuning
  // prefix held one) fails that sequence alone: no token is made up for it, and its blocks,
  // which may hold non-finite keys and values, go back (attention never reads past a
  // sequence's own length, so whoever reuses them is unaffected).
  std::vector<uint64_t> failed;
  auto fail = [&](const Sequence* s) {
    errors->push_back(
        {s->id, absl::InternalError("the model's logits for this request are NaN or infinite "
                                    "(a numerical overflow); the request was stopped")});
    failed.push_back(s->id);
  };
  struct Sample {
    Sequence* seq;
    size_t out_index;  // its StepOutput in *out
    Tensor rows;       // its logits on the host (it chooses from the last row); or
    int64_t top_row;   // its row of picks' TopLogits outputs (-1: none)
    int32_t logits_row;
  };
  std::vector<Sample> samples;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence* s = seqs[i];
    if (seq_rows[i].second == 0) {  // a prompt chunk: its keys and values are in the cache
      s->cached = ends[i];
      RegisterFullBlocks(s);
      continue;
    }
    if (picked[i].has_value()) {
      if (picked[i]->id < 0) {  // GreedyPick found a NaN or +inf
        fail(s);
      } else {
        Append(s, std::move(*picked[i]), out);
      }
      continue;
    }
    auto [first_row, count] = seq_rows[i];
    const int64_t top_row = picks.top_row[i];
    Tensor rows;
    if (top_row >= 0) {
      // TopLogits' log-sum-exp is NaN when the row holds a NaN or +inf.
      if (std::isnan(picks.stats.data<float>()[top_row * 2])) {
        fail(s);
        continue;
      }
    } else {
      rows = logits.Rows(first_row, first_row + count);
      if (rows.device() != kernels::Device::kCpu) rows = rows.ToDevice(kernels::Device::kCpu);
      if (!AllFinite(rows.data<float>(), count * v)) {
        fail(s);
        continue;
      }
    }
    if (!s->draft.empty()) {
      VerifyDraft(s, rows.data<float>(), v, out);
      continue;
    }
    StepOutput o;
    o.id = s->id;
    if (details[i] && model_->encoder_decoder()) {
      // TGIS: the input tokens of an encoder-decoder model come without logprobs (NaN).
      for (size_t p = s->encoder_prefix_len; p < s->encoder_ids.size(); ++p) {
        const int32_t id = s->encoder_ids[p];
        TokenInfo ti;
        ti.id = id;
        ti.logprob = std::numeric_limits<float>::quiet_NaN();
        ti.rank = 0;
        o.input_tokens.push_back(std::move(ti));
      }
    } else if (details[i]) {
      // Prompt details of the input's own tokens: token p's logprob comes from the logits after
      // token p - 1 (the last virtual token's, for the first input token after a prefix).
      if (s->prefix_len == 0) {
        TokenInfo ti;
        ti.id = s->tokens[0];
        ti.logprob = std::numeric_limits<float>::quiet_NaN();
        ti.rank = 0;
        o.input_tokens.push_back(std::move(ti));
      }
      const auto [first_detail, detail_count] = detail_span[i];
      const int32_t first_token = std::max<int32_t>(static_cast<int32_t>(s->prefix_len), 1);
      const int32_t chunk_rows = DetailRowsPerChunk(v);
      bool finite = true;
      for (int32_t c0 = 0; c0 < detail_count && finite; c0 += chunk_rows) {
        const int32_t c1 = std::min(detail_count, c0 + chunk_rows);
        const int64_t at = choosing + first_detail;
        Tensor chunk = model_->Logits(hidden.Rows(at + c0, at + c1));
        if (chunk.device() != kernels::Device::kCpu) chunk = chunk.ToDevice(kernels::Device::kCpu);
        finite = AllFinite(chunk.data<float>(), (c1 - c0) * v);
        if (!finite) break;
        // The rows are independent: their log-softmax and rank (O(vocabulary) each) side by
        // side.
        const size_t first = o.input_tokens.size();
        o.input_tokens.resize(first + (c1 - c0));
        kernels::ParallelTasks(c1 - c0, [&](int64_t k) {
          std::vector<float> row_lp;
          TokenInfo& ti = o.input_tokens[first + k];
          ti.id = s->tokens[first_token + c0 + k];
          LogSoftmaxInto(std::span<const float>(chunk.data<float>() + k * v, v), &row_lp);
          ti.logprob = row_lp[ti.id];
          RankAndTop(row_lp, ti.id, s->top_n, &ti.rank, &ti.top);
        });
      }
      if (!finite) {
        fail(s);
        continue;
      }
    }
    // The token is chosen below, with the other sampled sequences' (in parallel); its output
    // keeps its place.
    samples.push_back({s, out->size(), rows, top_row, first_row + count - 1});
    out->push_back(std::move(o));
  }
  // Each sequence has its own sampler (and random generator) and logits row, so they choose
  // side by side: a whole sampled row costs milliseconds at a 128K vocabulary (sampling_bench),
  // its largest values far less. First from the largest values where they were taken; the
  // rows where those were not enough are read whole (their penalty and bans already applied),
  // then every row read whole chooses.
  std::vector<TokenChoice> choices(samples.size());
  std::vector<char> chosen(samples.size(), 0);
  const int64_t tc = picks.count;
  kernels::ParallelTasks(static_cast<int64_t>(samples.size()), [&](int64_t k) {
    const Sample& c = samples[k];
    if (c.top_row < 0) return;
    std::optional<TokenChoice> choice = c.seq->sampler->NextFromTop(
        std::span<const float>(picks.values.data<float>() + c.top_row * tc, tc),
        std::span<const int32_t>(picks.ids.data<int32_t>() + c.top_row * tc, tc),
        picks.stats.data<float>()[c.top_row * 2], picks.stats.data<float>()[c.top_row * 2 + 1], v,
        c.seq->top_n);
    if (choice.has_value()) {
      choices[k] = std::move(*choice);
      chosen[k] = 1;
    }
  });
  for (Sample& c : samples) {
    if (c.top_row < 0 || chosen[&c - samples.data()]) continue;
    c.rows = logits.Rows(c.logits_row, c.logits_row + 1);
    if (c.rows.device() != kernels::Device::kCpu) c.rows = c.rows.ToDevice(kernels::Device::kCpu);
  }
  kernels::ParallelTasks(static_cast<int64_t>(samples.size()), [&](int64_t k) {
    const Sample& c = samples[k];
    if (chosen[k]) return;
    // The sampler's context (repetition penalty) is the real tokens, without placeholders.
    choices[k] =
        c.seq->sampler->Next(std::span<float>(c.rows.data<float>() + (c.rows.dim(0) - 1) * v, v),
                             std::span<const int32_t>(c.seq->tokens).subspan(c.seq->prefix_len),
                             c.seq->generated, c.seq->top_n, std::nullopt,
                             /*penalty_applied=*/c.top_row >= 0);
  });
  std::vector<size_t> unanswered;  // outputs of guided sequences no token could continue
  for (size_t k = 0; k < samples.size(); ++k) {
    if (choices[k].id < 0) {
      const uint64_t id = samples[k].seq->id;
      errors->push_back({id, absl::FailedPreconditionError(
                                 "guided decoding: no token of the vocabulary continues the text "
                                 "as the request's pattern requires")});
      failed.push_back(id);
      unanswered.push_back(samples[k].out_index);
      continue;
    }
    TokenInfo& t = (*out)[samples[k].out_index].token;
    t.id = choices[k].id;
    t.logprob = choices[k].logprob;
    t.rank = choices[k].rank;
    t.top = std::move(choices[k].top);
    Advance(samples[k].seq, t.id);
  }
  std::sort(unanswered.rbegin(), unanswered.rend());
  for (size_t at : unanswered) out->erase(out->begin() + static_cast<std::ptrdiff_t>(at));
  for (uint64_t id : failed) Release(id);
}

Tensor Engine::OnDevice(const std::vector<int32_t>& v, const kernels::Shape& shape) const {
  Tensor t = Tensor::FromVector(v, shape);
  return model_->device() == kernels::Device::kCpu ? t : t.ToDevice(model_->device());
}

kernels::AttentionBatch Engine::CrossBatch(const std::vector<Sequence*>& seqs,
                                           const std::vector<int32_t>& query_start,
                                           bool causal) const {
  size_t max_blocks = 1;
  for (const Sequence* s : seqs) max_blocks = std::max(max_blocks, s->cross_blocks.size());
  std::vector<int32_t> lens, tables(seqs.size() * max_blocks, 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    lens.push_back(static_cast<int32_t>(seqs[i]->encoder_ids.size()));
    std::copy(seqs[i]->cross_blocks.begin(), seqs[i]->cross_blocks.end(),
              tables.begin() + i * max_blocks);
  }
  const int64_t nseq = static_cast<int64_t>(seqs.size());
  kernels::AttentionBatch b;
  b.query_start = OnDevice(query_start, {nseq + 1});
  b.context_lens = OnDevice(lens, {nseq});
  b.block_tables = OnDevice(tables, {nseq, static_cast<int64_t>(max_blocks)});
  b.block_size = cache_->block_size();
  b.causal = causal;
  b.max_context_len = *std::max_element(lens.begin(), lens.end());
  NoteQueryLengths(query_start, &b);
  return b;
}

void Engine::Encode(const std::vector<Sequence*>& seqs) {
  const int bs = cache_->block_size();
  std::vector<int32_t> ids, positions, slots, query_start{0};
  for (const Sequence* s : seqs) {
    for (size_t p = 0; p < s->encoder_ids.size(); ++p) {
      ids.push_back(s->encoder_ids[p]);
      positions.push_back(static_cast<int32_t>(p));
      slots.push_back(s->cross_blocks[p / bs] * bs + static_cast<int32_t>(p % bs));
    }
    query_start.push_back(static_cast<int32_t>(ids.size()));
  }
  const int64_t t = static_cast<int64_t>(ids.size());
  ForwardInput in;
  in.input_ids = OnDevice(ids, {t});
  in.positions = OnDevice(positions, {t});
  in.slot_mapping = OnDevice(slots, {t});
  // Every input token sees the whole input: a non-causal batch over the cross blocks.
  in.attn = CrossBatch(seqs, query_start, /*causal=*/false);
  in.host_query_start = query_start;
  std::vector<PrefixSpan> spans;
  for (const Sequence* s : seqs) {
    in.host_context_lens.push_back(static_cast<int32_t>(s->encoder_ids.size()));
    spans.push_back({s->encoder_prefix.get(), s->encoder_prefix_len, 0, s->encoder_ids.size()});
  }
  AddPrefixRows(spans, &in);
  model_->Encode(in, cache_->layers());
}

void Engine::AddPrefixRows(const std::vector<PrefixSpan>& spans, ForwardInput* in) const {
  // Most steps have no virtual tokens (decode steps never do): nothing to build then.
  if (std::none_of(spans.begin(), spans.end(),
                   [](const PrefixSpan& s) { return s.begin < s.prefix_len; })) {
    return;
  }
  // Row i of the step takes row source[i] of [token embeddings (T rows); prefix rows]: itself,
  // or, for a virtual token (a position below its sequence's prefix length), its prefix row.
  int64_t t = 0;
  for (const PrefixSpan& s : spans) t += static_cast<int64_t>(s.end - s.begin);
  std::vector<int32_t> source;
  source.reserve(t);
  struct Piece {
    const kernels::Tensor* prefix;
    int64_t begin, end;  // prefix rows
  };
  std::vector<Piece> pieces;
  int64_t prefix_rows = 0;
  for (const PrefixSpan& s : spans) {
    for (size_t p = s.begin; p < s.end; ++p) {
      const bool virtual_token = p < s.prefix_len;
      source.push_back(static_cast<int32_t>(virtual_token ? t + prefix_rows++ : source.size()));
    }
    if (s.begin < std::min(s.end, s.prefix_len)) {
      pieces.push_back({s.prefix, static_cast<int64_t>(s.begin),
                        static_cast<int64_t>(std::min(s.end, s.prefix_len))});
    }
  }
  const int64_t hidden = model_->spec().EmbedDim();
  kernels::Tensor values =
      kernels::Tensor::Empty({prefix_rows, hidden}, model_->act_dtype(), model_->device());
  int64_t at = 0;
  for (const Piece& piece : pieces) {
    kernels::Tensor dst = values.Rows(at, at + piece.end - piece.begin);
    kernels::CopyColumns(piece.prefix->Rows(piece.begin, piece.end), 0, hidden, &dst, 0);
    at += piece.end - piece.begin;
  }
  in->embedding_source = OnDevice(source, {t});
  in->prefix_values = std::move(values);
}

void Engine::AddLoraRows(const std::vector<Sequence*>& seqs,
                         const std::vector<int32_t>& query_start, ForwardInput* in) const {
  std::map<const LoraWeights*, std::vector<int32_t>> rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i]->lora == nullptr) continue;
    std::vector<int32_t>& r = rows[seqs[i]->lora.get()];
    for (int32_t row = query_start[i]; row < query_start[i + 1]; ++row) r.push_back(row);
  }
  for (const auto& [adapter, r] : rows) {
    const int64_t n = static_cast<int64_t>(r.size());
    Tensor scales = Tensor::FromVector(std::vector<float>(r.size(), adapter->scale), {n});
    if (model_->device() != kernels::Device::kCpu) scales = scales.ToDevice(model_->device());
    const bool all_rows = rows.size() == 1 && r.size() == static_cast<size_t>(query_start.back());
    in->lora.push_back({adapter, OnDevice(r, {n}), std::move(scales), all_rows});
  }
}

void Engine::Advance(Sequence* s, int32_t token) {
  s->cached = s->tokens.size();
  s->tokens.push_back(token);
  s->generated += 1;
  RegisterFullBlocks(s);
}

void Engine::Append(Sequence* s, TokenInfo token, std::vector<StepOutput>* out) {
  StepOutput o;
  o.id = s->id;
  o.token = std::move(token);
  Advance(s, o.token.id);
  out->push_back(std::move(o));
}

Engine::DevicePicks Engine::PickOnDevice(const std::vector<Sequence*>& seqs,
                                         const std::vector<bool>& details,
                                         const std::vector<std::pair<int32_t, int32_t>>& seq_rows,
                                         Tensor* logits) {
  // A greedy pick: one logits row (no prompt details), no top-n (the rank of an argmax is 1)
  // and a plain greedy choice. A top row: any other sequence with a logits row and no draft
  // whose sampler can choose from the largest values. Either gets its repetition penalty and,
  // before min_new_tokens, its EOS ids banned on the device.
  DevicePicks picks;
  picks.greedy.resize(seqs.size());
  picks.top_row.assign(seqs.size(), -1);
  const size_t m = std::max<size_t>(1, eos_.size());
  const int64_t rows = logits->dim(0);
  std::vector<int32_t> banned(rows * m, -1);
  std::vector<bool> greedy(seqs.size(), false);
  std::vector<int32_t> top_rows;
  std::vector<float> temperatures;
  const TopValues when = g_top_values.load();
  const bool tops = when == TopValues::kAlways ||
                    (when == TopValues::kOnGpu && logits->device() != kernels::Device::kCpu);
  bool any_greedy = false, any_banned = false;
  // Rows with a repetition penalty: their context's distinct tokens, penalized on the device.
  std::vector<float> penalties(rows, 1.0f);
  std::vector<std::vector<int32_t>> penalized(rows);
  size_t most_penalized = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence* s = seqs[i];
    if (seq_rows[i].second == 0 || !s->draft.empty()) continue;
    const Sampler::DeviceSteps d = s->sampler->ForDevice(s->generated);
    greedy[i] = !details[i] && s->top_n == 0 && d.greedy;
    any_greedy = any_greedy || greedy[i];
    const int32_t row = seq_rows[i].first;
    if (!greedy[i]) {
      if (!tops || !d.from_top) continue;
      picks.top_row[i] = static_cast<int64_t>(top_rows.size());
      top_rows.push_back(row);
      temperatures.push_back(d.temperature);
    }
    const float penalty = d.repetition_penalty;
    const bool mask_eos = d.mask_eos;
    if (penalty != 1.0f) {
      penalties[row] = penalty;
      // The sampler's context: the real tokens, without prompt-tuning placeholders.
      std::vector<int32_t>& ctx = penalized[row];
      ctx.assign(s->tokens.begin() + static_cast<std::ptrdiff_t>(s->prefix_len), s->tokens.end());
      std::sort(ctx.begin(), ctx.end());
      ctx.erase(std::unique(ctx.begin(), ctx.end()), ctx.end());
      most_penalized = std::max(most_penalized, ctx.size());
    }
    if (mask_eos && !eos_.empty()) {
      std::copy(eos_.begin(), eos_.end(), banned.begin() + row * m);
      any_banned = true;
    }
  }
  if (!any_greedy && top_rows.empty()) return picks;
  // Rows of other sequences have nothing penalized or banned, so their logits stay as they
  // were for the host. Most steps penalize and ban nothing: no tables then (copies to the
  // device fewer).
  if (most_penalized > 0) {
    const int64_t width = static_cast<int64_t>(most_penalized);
    std::vector<int32_t> table(rows * width, -1);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(penalized[r].begin(), penalized[r].end(), table.begin() + r * width);
    }
    kernels::RepetitionPenalty(logits, OnDevice(table, {rows, width}),
                               Tensor::FromVector(penalties, {rows}).ToDevice(logits->device()));
  }
  if (any_greedy || any_banned) {
    // Every row is picked (cheap); only the greedy ones are used. The bans stay in the logits
    // for the top rows.
    Tensor banned_t;
    if (any_banned) banned_t = OnDevice(banned, {rows, static_cast<int64_t>(m)});
    Tensor ids, logprobs;
    kernels::GreedyPick(logits, banned_t, &ids, &logprobs);
    const Tensor ids_h = ids.ToDevice(kernels::Device::kCpu);  // a copy on the CPU: cheap
    const Tensor lps_h = logprobs.ToDevice(kernels::Device::kCpu);
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!greedy[i]) continue;
      TokenInfo t;
      t.id = ids_h.data<int32_t>()[seq_rows[i].first];
      t.logprob = lps_h.data<float>()[seq_rows[i].first];
      t.rank = 1;
      picks.greedy[i] = std::move(t);
    }
  }
  if (!top_rows.empty()) {
    const int64_t s = static_cast<int64_t>(top_rows.size());
    picks.count = std::min<int64_t>(kTopValues, logits->dim(1));
    Tensor values, ids, stats;
    kernels::TopLogits(*logits, OnDevice(top_rows, {s}),
                       Tensor::FromVector(temperatures, {s}).ToDevice(logits->device()),
                       picks.count, &values, &ids, &stats);
    picks.values = values.ToDevice(kernels::Device::kCpu);
    picks.ids = ids.ToDevice(kernels::Device::kCpu);
    picks.stats = stats.ToDevice(kernels::Device::kCpu);
  }
  return picks;
}

}  // namespace tgis::server

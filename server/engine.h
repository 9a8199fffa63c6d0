// The shard's engine: live sequences with their KV blocks, and steps that run any mix of
// prompt (prefill) and one-token (decode) work as one ragged forward pass.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/decode_graphs.h"
#include "server/guided_decoding.h"
#include "server/kv_cache.h"
#include "server/lora.h"
#include "server/model.h"
#include "server/sampling.h"

namespace tgis::server {

struct NewSequence {
  uint64_t id = 0;
  std::vector<int32_t> input_ids;
  SamplingParams params;
  uint32_t max_new_tokens = 0;
  uint32_t top_n = 0;
  bool input_logprobs = false;
  // Speculative decoding by prompt lookup: each Decode step may verify up to this many draft
  // tokens, copied from where the sequence's last tokens occurred before, and return every one
  // that decoding accepts (greedy: chooses; sampling: accepts by rejection sampling, which
  // keeps the distribution), plus one.
  uint32_t speculate = 0;
  // A prompt-tuning prefix [virtual tokens, hidden] (model dtype and device) that goes before
  // the input: its vectors take positions 0..P-1, the input's tokens follow.
  std::shared_ptr<const kernels::Tensor> prefix;
  // Encoder-decoder models: a prefix before the input, in the encoder (`prefix` goes before the
  // decoder start token).
  std::shared_ptr<const kernels::Tensor> encoder_prefix;
  // A LoRA adapter (Model::MakeLora) whose deltas this sequence's every token takes.
  std::shared_ptr<const LoraWeights> lora;
  // Guided decoding: the generated text must follow this automaton (guided_decoding.h). Such a
  // sequence does not speculate.
  std::shared_ptr<GuidedAutomaton> guided;
  // Resumes the preempted sequence `id` (every other field is ignored): its tokens are
  // computed again and it gets its next token.
  bool resume = false;
};

struct TokenInfo {
  int32_t id = 0;
  float logprob = 0;
  uint32_t rank = 1;
  std::vector<TopToken> top;
};

struct StepOutput {
  uint64_t id = 0;
  TokenInfo token;
  std::vector<TokenInfo> input_tokens;  // prompt details, when asked (first has NaN logprob)
};

// The most bytes of f32 logits a prompt's details take at once (64 MB; tests make it small).
void SetDetailChunkBytesForTesting(int64_t bytes);
// Sampled rows choose from their largest values (TopLogits) where the logits are on a GPU; on
// the CPU, where the whole row is already on the host and that is no cheaper, they read it
// whole. Tests run either path anywhere, to check one against the other.
enum class TopValues { kOnGpu, kAlways, kNever };
void SetTopValuesForTesting(TopValues when);

struct SequenceError {
  uint64_t id = 0;
  absl::Status status;
};

// What prompt-lookup speculation did in one Decode call.
struct DraftStats {
  uint32_t proposed = 0;  // draft tokens verified
  uint32_t accepted = 0;  // of them, tokens greedy decoding chose
};

// What prefix caching saved in one Prefill call.
struct PrefillReuse {
  uint32_t sequences = 0;      // sequences that took at least one cached block
  uint64_t reused_tokens = 0;  // prompt tokens not computed again
};

// Whether a token's keys and values are the same however and whenever they are computed (not
// so with rotary frequencies that follow the sequence's length): what prefix caching and
// preemption's recomputation rely on.
bool KeysIndependentOfLength(const Model& model);

// One sequence's recurrent states (DecoderSpec::RecurrentStateShapes) in bytes, as the engine
// keeps them (f32, one slot per live sequence); 0 for models without.
size_t RecurrentStateBytes(const DecoderSpec& spec);

class Engine {
 public:
  // `max_positions`: the config's max_position_embeddings; a model whose rope scaling serves
  // more (DecoderSpec::max_positions) takes its own. `prefix_caching`: a prompt starting with
  // tokens whose keys and values are cached (from any earlier or running sequence) takes them
  // and computes only the rest (see PrefixCachingApplies for the models it leaves out).
  Engine(std::unique_ptr<Model> model, std::vector<int32_t> eos_ids, int64_t max_positions,
         int num_blocks, int block_size, bool prefix_caching = false);

  // Adds sequences and runs their prompts; each surviving one gets its first token (a resumed
  // one its next). Bad or unservable sequences come back as errors and are not kept; a resumed
  // one whose blocks do not fit stays preempted and is listed in `preempted` (when given;
  // else it fails).
  //
  // Chunked prefill: with `prompt_budget` > 0 (and `prefilling` given), a step computes at most
  // that many prompt tokens, oldest sequences first; a sequence whose prompt is not done gets
  // no token yet, is listed in `prefilling`, and goes on in the next Prefill or Decode that
  // lists it (beside decoding sequences, in the same forward pass). Prompts asking for prompt
  // logprobs, encoder-decoder models and length-dependent rotary are never chunked.
  void Prefill(std::vector<NewSequence> seqs, std::vector<StepOutput>* out,
               std::vector<SequenceError>* errors, std::vector<uint64_t>* preempted = nullptr,
               size_t prompt_budget = 0, std::vector<uint64_t>* prefilling = nullptr);
  // One more token for each listed live sequence. When the KV cache cannot hold them all, the
  // newest are preempted until the rest fit (when `preempted` is given): their blocks are
  // freed, their tokens and sampler kept, and they are listed there, to be resumed later by a
  // Prefill. A sequence that cannot fit even alone (or any, without `preempted`) is dropped
  // with an error; the others proceed. Models that cannot preempt (can_preempt) never do.
  // Sequences still prefilling go on with their prompts (see Prefill's `prompt_budget`).
  void Decode(const std::vector<uint64_t>& ids, std::vector<StepOutput>* out,
              std::vector<SequenceError>* errors, std::vector<uint64_t>* preempted = nullptr,
              size_t prompt_budget = 0, std::vector<uint64_t>* prefilling = nullptr);
  // Those of `ids` that the router cannot have finished after their last token (they are
  // decoding, not prefilling or speculating, have tokens left to generate and positions to take
  // them, and their last token ends nothing), if the KV cache holds a step for all of them
  // without preempting anyone; else none. See StepAhead.
  std::vector<uint64_t> DecodableAhead(const std::vector<uint64_t>& ids);
  void Release(uint64_t id);
  void ReleaseAll();
  bool Has(uint64_t id) const { return seqs_.count(id) > 0; }
  bool Preempted(uint64_t id) const {
    auto it = seqs_.find(id);
    return it != seqs_.end() && it->second->preempted;
  }
  size_t CachedTokens(uint64_t id) const;
  const Model& model() const { return *model_; }
  int num_blocks() const { return cache_->num_blocks(); }
  // Blocks a new sequence can still get (cached blocks nobody holds count: they are evicted
  // on demand).
  int free_blocks() { return cache_->blocks().available(); }
  int block_size() const { return cache_->block_size(); }
  bool prefix_caching() const { return prefix_caching_; }
  // Whether Decode may preempt (a model whose keys depend on the sequence's length cannot
  // compute a preempted sequence's tokens again exactly: see engine.cc).
  bool can_preempt() const { return keys_independent_of_length_; }
  // What prefix caching saved in the last Prefill.
  const PrefillReuse& last_reuse() const { return last_reuse_; }
  // What speculation did in the last Decode.
  const DraftStats& last_drafts() const { return last_drafts_; }

  // Nanoseconds spent in the last step's forward pass.
  uint64_t last_forward_ns() const { return last_forward_ns_; }

  // The most tokens one step may compute (0: no limit): the largest step the shard's memory was
  // sized and proven for at Warmup. A step that would compute more refuses its newest prompts
  // (RESOURCE_EXHAUSTED) until it fits, so no step asks for memory that warmup did not.
  void set_max_step_tokens(size_t tokens) { max_step_tokens_ = tokens; }
  // Decode steps of up to DecodeGraphs::kMaxBatch sequences replay captured CUDA graphs, one
  // per batch and context bucket: with `capture_batch` > 0 every bucket up to that batch and
  // the longest context is captured now (warmup), else each on first use. False, and nothing
  // changes, when the model cannot (DecodeGraphs::Supports: CPU, encoder-decoder, several
  // ranks, rotary frequencies chosen per length, a mixture of experts).
  bool EnableDecodeGraphs(int64_t capture_batch = 0);
  size_t max_step_tokens() const { return max_step_tokens_; }

 private:
  struct Sequence {
    uint64_t id;
    std::vector<int32_t> tokens;  // virtual-token placeholders, prompt, then generated
    size_t prompt_len;
    std::shared_ptr<const kernels::Tensor> prefix;
    size_t prefix_len = 0;  // virtual tokens at the start of `tokens`
    size_t cached = 0;      // tokens whose keys/values are in the cache
    std::vector<int32_t> blocks;
    // Encoder-decoder models: the input (the encoder's tokens; `tokens` are the decoder's,
    // from the decoder start token) and the blocks of its cross-attention keys/values.
    std::vector<int32_t> encoder_ids;  // virtual-token placeholders, then the input
    std::vector<int32_t> cross_blocks;
    std::shared_ptr<const kernels::Tensor> encoder_prefix;
    size_t encoder_prefix_len = 0;
    std::shared_ptr<const LoraWeights> lora;
    // Prefix caching: the node of the last block registered in the cache (0: the sequence's
    // blocks are never shared) and how many of its blocks are registered.
    BlockCache::Node chain = 0;
    size_t registered = 0;
    uint64_t order = 0;      // admission order: the newest are preempted first
    bool preempted = false;  // blocks freed; resumed by a Prefill
    std::unique_ptr<Sampler> sampler;
    uint32_t generated = 0;
    uint32_t top_n = 0;
    bool input_logprobs = false;
    uint32_t max_new = 0;
    uint32_t speculate = 0;
    // This step's draft tokens (appended to `tokens` while the step runs).
    std::vector<int32_t> draft;
    // Models with recurrent states: the slot of states_ this sequence's are in (-1: none).
    int32_t state_slot = -1;
  };
  // A slot of recurrent states for s (reusing a released one, else a new one).
  void AcquireState(Sequence* s);
  void ReleaseState(Sequence* s);

  // Blocks s lacks for the keys of all its tokens (cross-attention's are reserved at prefill).
  size_t MissingBlocks(const Sequence& s) const;
  // Reserves blocks for every uncached token of s; false when the cache is full.
  bool Reserve(Sequence* s);
  void FreeBlocks(Sequence* s);
  // Frees s's blocks, keeping its tokens and sampler, until it is resumed.
  void Preempt(Sequence* s);
  // Reserves blocks for every listed sequence, oldest first; when the cache runs out, preempts
  // the newest (listing them in `preempted`) or, without `preempted` or for one that cannot fit
  // alone, drops it with an error. Returns the sequences that got their blocks, in order.
  std::vector<Sequence*> ReserveOrPreempt(const std::vector<Sequence*>& seqs,
                                          std::vector<SequenceError>* errors,
                                          std::vector<uint64_t>* preempted);
  // Takes the longest cached run of s's prompt, leaving at least its last token to compute.
  void ReuseCachedPrefix(Sequence* s);
  // Adds s's prompt tokens taken from the cache (if any) to last_reuse_.
  void CountReuse(const Sequence& s);
  // Registers s's blocks that are full and computed, for later sequences to share.
  void RegisterFullBlocks(Sequence* s);
  // Runs one forward pass over seqs[i]'s tokens [cached, ends[i]); a sequence whose end is its
  // last token gets its next token, the others only advance `cached`. A sequence whose logits
  // hold a NaN or +inf gets an error instead and is released; the others go on.
  void Run(const std::vector<Sequence*>& seqs, const std::vector<size_t>& ends, bool prefill,
           std::vector<StepOutput>* out, std::vector<SequenceError>* errors);
  // Plans a step: each sequence's end under the prompt budget (0: everything), and the
  // sequences with tokens to compute in it; those still short of their last token after it
  // are listed in `prefilling`.
  void RunStep(const std::vector<Sequence*>& seqs, bool prefill, size_t prompt_budget,
               std::vector<StepOutput>* out, std::vector<SequenceError>* errors,
               std::vector<uint64_t>* prefilling);
  bool Chunkable(const Sequence& s) const;
  // The indices of `seqs`, oldest sequence first.
  static std::vector<size_t> OldestFirst(const std::vector<Sequence*>& seqs);
  // Refuses (error, released, end set to kRefused) the newest sequences that would take a step
  // past max_step_tokens_; `ends` are the step's planned ends. False when none was refused.
  bool RefuseBeyondStepLimit(const std::vector<Sequence*>& seqs, std::vector<size_t>* ends,
                             std::vector<SequenceError>* errors);
  // Prompt lookup: the tokens that followed the latest earlier occurrence of s's last 3 (else
  // 2, else 1) tokens, at most `limit` of them.
  std::vector<int32_t> ProposeDraft(const Sequence& s, size_t limit) const;
  // Gives decoding sequences their drafts (appended to their tokens, blocks reserved).
  void AddDrafts(const std::vector<Sequence*>& seqs);
  // Verifies s's draft against the step's logits rows for it (host floats, one per draft
  // token and one more): appends the tokens decoding chooses, as long as they are the draft's.
  void VerifyDraft(Sequence* s, const float* rows, int64_t vocab, std::vector<StepOutput>* out);
  // Encoder-decoder models: encodes the new sequences' inputs into their cross blocks.
  void Encode(const std::vector<Sequence*>& seqs);
  // The attention batch of each sequence's cross blocks (context: its input's length), for
  // query rows `query_start`.
  kernels::AttentionBatch CrossBatch(const std::vector<Sequence*>& seqs,
                                     const std::vector<int32_t>& query_start, bool causal) const;
  // `n` blocks more for `blocks`, all or none; false when the cache is full.
  bool AllocateBlocks(size_t n, std::vector<int32_t>* blocks);
  kernels::Tensor OnDevice(const std::vector<int32_t>& v, const kernels::Shape& shape) const;
  // Rows [begin, end) of one sequence's tokens in a step, whose first `prefix_len` positions
  // are virtual tokens taking `prefix`'s rows.
  struct PrefixSpan {
    const kernels::Tensor* prefix;
    size_t prefix_len, begin, end;
  };
  // The prefix rows of a step's input (prompt tuning), if any span has virtual tokens.
  void AddPrefixRows(const std::vector<PrefixSpan>& spans, ForwardInput* in) const;
  // The rows of a step (seqs[i]'s from row query_start[i]) that take each LoRA adapter.
  void AddLoraRows(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& query_start,
                   ForwardInput* in) const;
  // What a step's logits give the host without being read whole (on CUDA they stay on the
  // device): the choices of the sequences whose next token is a plain greedy one, and, for those
  // that sample or want details from the largest values alone (Sampler::TopChoosable), those
  // values (TopLogits). Their repetition penalty and EOS ban are applied where the logits are.
  struct DevicePicks {
    std::vector<std::optional<TokenInfo>> greedy;  // per sequence; nullopt: not picked
    std::vector<int64_t> top_row;                  // per sequence: its TopLogits row, or -1
    int64_t count = 0;                             // values per TopLogits row
    kernels::Tensor values, ids, stats;            // TopLogits' outputs, on the host
  };
  // seq_rows: each sequence's [first logits row, count].
  DevicePicks PickOnDevice(const std::vector<Sequence*>& seqs, const std::vector<bool>& details,
                           const std::vector<std::pair<int32_t, int32_t>>& seq_rows,
                           kernels::Tensor* logits);
  // Records `token` as s's next one.
  void Advance(Sequence* s, int32_t token);
  void Append(Sequence* s, TokenInfo token, std::vector<StepOutput>* out);

  std::unique_ptr<Model> model_;
  std::unique_ptr<DecodeGraphs> graphs_;  // null: every step runs eagerly
  std::vector<int32_t> eos_;
  int64_t max_positions_;
  std::unique_ptr<KvCache> cache_;
  std::map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  uint64_t last_forward_ns_ = 0;
  size_t max_step_tokens_ = 0;
  bool prefix_caching_ = false;
  // KeysIndependentOfLength(model): preemption, chunking and speculation all rely on it.
  bool keys_independent_of_length_ = false;
  // Models with recurrent layers (DecoderSpec::RecurrentStateShapes): one slot of states per
  // live sequence, kept for reuse once released (their number follows the most sequences
  // alive at once).
  std::vector<kernels::Shape> state_shapes_;
  std::vector<std::vector<kernels::Tensor>> states_;
  std::vector<int32_t> free_states_;
  PrefillReuse last_reuse_;
  DraftStats last_drafts_;
  uint64_t next_order_ = 0;
};

}  // namespace tgis::server

// Guided decoding in the shard: a request's byte automaton (compiled by the router from its
// regex, choices or JSON schema, grammar/grammar.h) decides which tokens may come next. A
// token may come when its bytes (the router's Tokenizer::TokenBytes, sent at warmup) walk the
// automaton from the text so far without falling off; the EOS tokens may come when the text
// so far is complete. The mask of each automaton state is computed once, the first time any
// request reaches it, and shared by every request with the same automaton.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/lru_cache.h"
#include "grammar/grammar.h"

namespace tgis::server {

// Each token id's bytes in generated text; empty: a token guided decoding never picks
// (special tokens, ids the tokenizer does not have).
using TokenBytesTable = std::vector<std::string>;

// A vocabulary's token bytes, also as a trie (the tokens sorted by their bytes, each shared
// prefix a node once), so that a state's mask steps the automaton once per prefix instead of
// once per token byte, and a prefix the automaton rejects rejects every token under it unread.
class GuidedVocabulary {
 public:
  explicit GuidedVocabulary(TokenBytesTable bytes);
  const TokenBytesTable& bytes() const { return bytes_; }
  size_t size() const { return bytes_.size(); }
  // The tokens whose bytes walk `dfa` from `state` without falling off, one bit per id.
  std::vector<uint64_t> Allowed(const grammar::ByteDfa& dfa, int32_t state) const;

 private:
  TokenBytesTable bytes_;
  // The trie's nodes in preorder (the root left out): node i adds byte_[i] at depth_[i] (1:
  // a first byte), its subtree ends before node skip_[i], and the tokens whose bytes end there
  // are ids_[first_id_[i] .. first_id_[i + 1]).
  std::vector<uint8_t> byte_;
  std::vector<int32_t> depth_, skip_, first_id_, ids_;
  int32_t max_depth_ = 0;
};

// An automaton over a vocabulary, with the masks of the states reached so far. Thread-safe:
// the sequences of a step choose their tokens side by side.
class GuidedAutomaton {
 public:
  GuidedAutomaton(std::shared_ptr<const grammar::ByteDfa> dfa,
                  std::shared_ptr<const GuidedVocabulary> vocabulary);
  const grammar::ByteDfa& dfa() const { return *dfa_; }
  const GuidedVocabulary& vocabulary() const { return *vocabulary_; }
  // The tokens whose bytes continue the text from `state`, one bit per id.
  std::shared_ptr<const std::vector<uint64_t>> Allowed(int32_t state);

 private:
  std::shared_ptr<const grammar::ByteDfa> dfa_;
  std::shared_ptr<const GuidedVocabulary> vocabulary_;
  std::mutex mu_;
  std::unordered_map<int32_t, std::shared_ptr<const std::vector<uint64_t>>> masks_;
};

// The automata of the last few distinct constraints (clients repeat their schemas), by the
// router's encoding of each; a new vocabulary empties it.
class GuidedAutomatonCache {
 public:
  explicit GuidedAutomatonCache(size_t entries = 16) : cache_(static_cast<double>(entries)) {}
  void SetVocabulary(std::shared_ptr<const GuidedVocabulary> vocabulary);
  bool has_vocabulary() const { return vocabulary_ != nullptr; }
  // The automaton `key` stands for; `make` builds its ByteDfa when it is not cached.
  template <typename MakeDfa>
  std::shared_ptr<GuidedAutomaton> Get(const std::string& key, MakeDfa make);

 private:
  std::shared_ptr<const GuidedVocabulary> vocabulary_;
  LruCache<std::shared_ptr<GuidedAutomaton>> cache_;
};

// One sequence's place in its automaton.
class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<GuidedAutomaton> automaton, std::vector<int32_t> eos);

  // Sets every entry of `logits` (one per token id) that may not come next to -inf. False when
  // no token at all may come (the vocabulary has none that continues the text).
  bool Mask(std::span<float> logits);
  // Whether the text so far is complete and nothing may follow it but an EOS token (the
  // pattern allows nothing more, or no token of the vocabulary continues it).
  bool MustEnd() const;
  // The text goes on with `token` (one Mask allowed).
  void Advance(int32_t token);
  int32_t state() const { return state_; }

 private:
  std::shared_ptr<GuidedAutomaton> automaton_;
  std::vector<int32_t> eos_;
  int32_t state_ = 0;
  bool ended_ = false;  // an EOS was chosen
};

template <typename MakeDfa>
std::shared_ptr<GuidedAutomaton> GuidedAutomatonCache::Get(const std::string& key, MakeDfa make) {
  if (auto* cached = cache_.Find(key)) return *cached;
  std::shared_ptr<const grammar::ByteDfa> dfa = make();
  if (dfa == nullptr) return nullptr;
  return cache_.Insert(key, std::make_shared<GuidedAutomaton>(std::move(dfa), vocabulary_));
}

}  // namespace tgis::server

// Guided decoding in the shard: a request's byte automaton (compiled by the router from its
// regex or choices, grammar/grammar.h) decides which tokens may come next. A token may come
// when its bytes (the router's Tokenizer::TokenBytes, sent at warmup) walk the automaton from
// the text so far without falling off; the EOS tokens may come when the text so far is
// complete. The mask of each automaton state is computed once per request, when the state is
// first reached.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/grammar.h"

namespace tgis::server {

// Each token id's bytes in generated text; empty: a token guided decoding never picks
// (special tokens, ids the tokenizer does not have).
using TokenBytesTable = std::vector<std::string>;

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const grammar::ByteDfa> dfa,
                  std::shared_ptr<const TokenBytesTable> vocabulary, std::vector<int32_t> eos);

  // Sets every entry of `logits` (one per token id) that may not come next to -inf. False when
  // no token at all may come (the vocabulary has none that continues the text).
  bool Mask(std::span<float> logits);
  // Whether the text so far is complete and nothing may follow it but an EOS token.
  bool MustEnd() const;
  // The text goes on with `token` (one Mask allowed).
  void Advance(int32_t token);

 private:
  const std::vector<uint64_t>& Allowed();

  std::shared_ptr<const grammar::ByteDfa> dfa_;
  std::shared_ptr<const TokenBytesTable> vocabulary_;
  std::vector<int32_t> eos_;
  int32_t state_ = 0;
  bool ended_ = false;                                        // an EOS was chosen
  std::unordered_map<int32_t, std::vector<uint64_t>> masks_;  // state -> allowed token bits
};

}  // namespace tgis::server

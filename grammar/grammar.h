// Guided decoding's languages as byte automata: a regular expression (Python `re` syntax, the
// generated text must match it whole) or a list of choices (the text is one of them) compiled
// to a deterministic automaton over UTF-8 bytes. The router compiles a request's constraint
// once; the shard walks each vocabulary token's bytes through it to know which tokens may come
// next (server/guided_decoding.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::grammar {

// A deterministic automaton over bytes. States are 0..num_states()-1, the start is 0; every
// state can still reach an accepting one (a byte that could not lead to a match has no
// transition), so a walk that never falls off can always be completed.
struct ByteDfa {
  static constexpr int32_t kDead = -1;
  std::array<uint8_t, 256> byte_class{};  // bytes that behave alike share a class
  int32_t num_classes = 1;
  std::vector<int32_t> next;  // [state * num_classes + class]: next state or kDead
  std::vector<bool> accepting;

  int32_t num_states() const { return static_cast<int32_t>(accepting.size()); }
  int32_t Step(int32_t state, uint8_t byte) const {
    return next[static_cast<size_t>(state) * num_classes + byte_class[byte]];
  }
  // The state after `bytes` from `state`, or kDead.
  int32_t Walk(int32_t state, std::string_view bytes) const;
  // Whether the automaton accepts `text` whole.
  bool Matches(std::string_view text) const;
  // Whether `state` has any transition (else only stopping there is allowed).
  bool HasTransitions(int32_t state) const;
  // A structural check for an automaton received from elsewhere (sizes, targets in range).
  absl::Status Validate() const;
};

// The most states a compiled automaton may have: a larger one is refused as too complex
// (its determinization costs time and memory that one request should not take).
inline constexpr int32_t kMaxDfaStates = 20000;

// A regular expression in Python `re` syntax, matched against the whole text (as vLLM's guided
// decoding and outlines do). Supported: literals and escapes (\n \t \xhh \uhhhh \U..., \. ...),
// classes ([a-z], [^...], \d \w \s and their negations, with ASCII meanings as xgrammar gives
// them), `.` (any character but a newline), groups ((...), (?:...), (?P<name>...)),
// alternation, quantifiers (* + ? {m} {m,} {,n} {m,n}, lazy forms alike), and ^ / $ at the
// ends. Refused by name: backreferences, lookarounds, word boundaries, inline flags,
// possessive quantifiers and conditionals (no regular language, or not one this compiler
// keeps); a syntax error names its position.
absl::StatusOr<ByteDfa> CompileRegex(std::string_view pattern);

// The text must be exactly one of `choices` (UTF-8 strings).
absl::StatusOr<ByteDfa> CompileChoices(const std::vector<std::string>& choices);

// How deep free-form JSON (format JSON, a schema's object without properties, an array without
// items) may nest: a regular language needs a bound; this one keeps the automaton small.
inline constexpr int kFreeJsonDepth = 4;

// A JSON value valid under `schema` (JSON Schema text), written compactly with at most one
// space between tokens, object properties in the schema's order (outlines' construction).
// Served: type (and lists of types), properties, required, additionalProperties, items,
// minItems, maxItems, enum, const, anyOf, oneOf (as anyOf), allOf of one schema, local $ref
// (not recursive), minLength, maxLength, pattern, format date / time / date-time / uuid; the
// annotations (title, description, default, examples, $schema, $id, $comment, $defs,
// definitions, deprecated, readOnly, writeOnly, discriminator) are skipped. Any other keyword
// (minimum, multipleOf, uniqueItems, patternProperties, if/then/else, not, ...) is refused by
// name (Unimplemented) rather than ignored.
absl::StatusOr<ByteDfa> CompileJsonSchema(std::string_view schema);

// Any JSON object (format JSON, as vLLM serves it: the schema {"type": "object"}).
absl::StatusOr<ByteDfa> CompileJsonObject();

// A GBNF grammar (llama.cpp's EBNF, as xgrammar reads vLLM's `grammar`) whose language is
// regular: rules are inlined from `root`, a reference in the tail of a rule being expanded
// loops back to its start (right recursion), any other recursion is refused by name
// (Unimplemented).
// Literals, character classes, `.`, grouping, alternation, * + ? {m} {m,} {m,n}, comments.
absl::StatusOr<ByteDfa> CompileGbnf(std::string_view grammar);

}  // namespace tgis::grammar

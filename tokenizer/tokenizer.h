// Tokenizers for Hugging Face model folders: tokenizer.json (BPE, byte-level BPE, Unigram,
// WordPiece pipelines) or a SentencePiece model (tokenizer.model / spiece.model). Encodings
// match HF `tokenizers` / `sentencepiece` token for token, with byte offsets into the input.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tgis {

struct TokenOffset {
  uint32_t start = 0;  // byte offsets into the encoded text; [0, 0) for inserted specials
  uint32_t end = 0;
  bool operator==(const TokenOffset&) const = default;
};

struct Encoding {
  std::vector<int32_t> ids;
  std::vector<std::string> tokens;  // the vocabulary strings of the ids
  std::vector<TokenOffset> offsets;
};

struct SpecialTokenIds {
  std::optional<int32_t> bos;
  std::optional<int32_t> eos;
  std::optional<int32_t> pad;
  std::optional<int32_t> unk;
};

// Whether `text` is well-formed UTF-8 (what Encode requires and protobuf string fields hold).
bool IsValidUtf8(std::string_view text);

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Loads a model folder: tokenizer.json when present, else GPT-2 style vocab.json + merges.txt
  // (converted as transformers converts them), else tokenizer.model / spiece.model;
  // tokenizer_config.json and special_tokens_map.json supply the special tokens. Errors name
  // the file and, for JSON, the field.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDirectory(const std::string& dir);

  // Text must be valid UTF-8 (InvalidArgument otherwise).
  virtual absl::StatusOr<Encoding> Encode(std::string_view text, bool add_special_tokens) const = 0;
  // Unknown ids are skipped, as HF does.
  virtual absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                             bool skip_special_tokens) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  // One past the largest id the tokenizer can produce or decode.
  virtual size_t VocabSize() const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  // True when Decode may hold text back at id until a later id arrives (byte-fallback tokens
  // are decoded as a group; see IncrementalDecoder).
  virtual bool DecodesAsByteGroup(int32_t id) const = 0;
  // The bytes token `id` adds to a decoded text in its middle (what guided decoding matches
  // generated text against): a byte-level or byte-fallback token's raw bytes (possibly part of
  // a character), SentencePiece's word marker as a space. nullopt for special tokens and ids
  // outside the vocabulary (guided decoding never picks them).
  virtual std::optional<std::string> TokenBytes(int32_t id) const = 0;

  const SpecialTokenIds& special_ids() const { return special_; }

 protected:
  SpecialTokenIds special_;
};

// Streaming detokenizer: fed generated ids one at a time, it returns the text that became
// final. The concatenation of everything returned (including Flush) equals
// Decode(context + ids) minus Decode(context). Incomplete UTF-8 is held back, never emitted
// as U+FFFD, until it completes or Flush is called.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens,
                     std::span<const int32_t> context = {});
  absl::StatusOr<std::string> Next(int32_t id);
  absl::StatusOr<std::string> Flush();
  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  absl::StatusOr<std::string> Step(bool final);

  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // context followed by generated ids
  size_t prefix_offset_ = 0;
  size_t read_offset_ = 0;
};

}  // namespace tgis

// The stages of a tokenizer.json pipeline (normalizer, pre-tokenizer, model, post-processor,
// decoder) as small interfaces, and the factories that build them from their JSON objects.
// Every factory rejects what it does not implement, naming the JSON path, so that an
// unsupported tokenizer is a load error and never a silently different tokenization.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tokenizer/src/normalized_string.h"

namespace tgis::tok {

using Json = nlohmann::json;

struct Token {
  int32_t id;
  std::string value;
  Span offsets;  // byte offsets inside the normalized piece the model saw
};

// The input split into pieces; a piece with tokens was already decided (an added token).
struct PreTokenizedString {
  struct Piece {
    NormalizedString text;
    bool has_tokens = false;
    std::vector<Token> tokens;
  };
  std::vector<Piece> pieces;

  // Replaces each undecided piece by the result of fn; empty results are dropped.
  template <typename Fn>
  absl::Status SplitEach(Fn&& fn) {
    std::vector<Piece> next;
    next.reserve(pieces.size());
    for (Piece& p : pieces) {
      if (p.has_tokens) {
        next.push_back(std::move(p));
        continue;
      }
      std::vector<NormalizedString> parts;
      absl::Status st = fn(p.text, &parts);
      if (!st.ok()) return st;
      for (NormalizedString& ns : parts) {
        if (ns.empty()) continue;
        next.push_back(Piece{std::move(ns), false, {}});
      }
    }
    pieces = std::move(next);
    return absl::OkStatus();
  }
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void Normalize(NormalizedString* s) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual absl::Status PreTokenize(PreTokenizedString* s) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  // Tokenizes one pre-tokenized piece; token offsets are relative to the piece.
  virtual absl::Status Tokenize(std::string_view piece, std::vector<Token>* out) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual const std::string* IdToToken(int32_t id) const = 0;
  virtual size_t VocabSize() const = 0;
};

// The encoding as post-processors see it.
struct RawEncoding {
  std::vector<int32_t> ids;
  std::vector<std::string> tokens;
  std::vector<Span> offsets;
  std::vector<uint8_t> special;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void Process(RawEncoding* enc, bool add_special_tokens) const = 0;
  // Number of special tokens Process adds to a single sequence.
  virtual size_t AddedTokens() const { return 0; }
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const = 0;
  // The bytes one token adds in the middle of a text (Tokenizer::TokenBytes): no edge of the
  // text is near, and byte tokens stay raw bytes. `whole_text`: an earlier decoder fused the
  // pieces into one text.
  virtual std::string MidPiece(std::string token, bool* whole_text) const = 0;
};

// Looks up token ids while building post-processors (special tokens of templates).
using TokenIdLookup = std::function<std::optional<int32_t>(std::string_view)>;

absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const Json& j, const std::string& path);
absl::StatusOr<std::unique_ptr<PreTokenizer>> MakePreTokenizer(const Json& j,
                                                               const std::string& path);
absl::StatusOr<std::unique_ptr<Model>> MakeModel(const Json& j, const std::string& path);
absl::StatusOr<std::unique_ptr<PostProcessor>> MakePostProcessor(const Json& j,
                                                                 const std::string& path);
absl::StatusOr<std::unique_ptr<Decoder>> MakeDecoder(const Json& j, const std::string& path);

// JSON field helpers that turn a wrong type or a missing field into an error naming the path.
absl::StatusOr<const Json*> Field(const Json& j, const std::string& path, const char* key);
absl::StatusOr<std::string> StringField(const Json& j, const std::string& path, const char* key);
absl::StatusOr<bool> BoolField(const Json& j, const std::string& path, const char* key,
                               std::optional<bool> default_value = std::nullopt);
absl::Status Unsupported(const std::string& path, std::string_view what);
// The most token ids a tokenizer may use: vocabularies are dense arrays here (HF's are hash
// maps), so an id is also a size; 2^24 is far beyond any real vocabulary.
inline constexpr int64_t kMaxTokenIds = int64_t{1} << 24;
// A token id: an integer in [0, kMaxTokenIds), else an error naming `where`.
absl::StatusOr<int32_t> TokenId(const Json& value, const std::string& where);
// A count or position field (HF's usize): missing or null gives `default_value`; otherwise an
// integer in [0, max], else an error naming the field. A float such as 2e32 is an error, never
// converted (that conversion is undefined behaviour).
absl::StatusOr<int64_t> CountField(const Json& j, const std::string& path, const char* key,
                                   int64_t default_value, int64_t max);

}  // namespace tgis::tok

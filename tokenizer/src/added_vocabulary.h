// Added tokens of tokenizer.json: found in the text before the model runs (leftmost-longest),
// with HF's single_word / lstrip / rstrip / normalized rules.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "tokenizer/src/pipeline.h"

namespace tgis::tok {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

class AddedVocabulary {
 public:
  // `model_id` looks a content up in the model's vocabulary: as in HF, an added token whose
  // content the model already has takes the model's id, whatever the file says.
  absl::Status Load(const Json& list, const std::string& path, const Normalizer* normalizer,
                    const std::function<std::optional<int32_t>(std::string_view)>& model_id);

  // Splits pieces on added tokens: first the raw text on non-normalized tokens, then each rest
  // is normalized and split on normalized tokens.
  void ExtractAndNormalize(std::string_view text, const Normalizer* normalizer,
                           PreTokenizedString* out) const;

  // A split of a text: [start, end) and the added token's id there, or -1 for plain text.
  struct TextSplit {
    size_t start;
    size_t end;
    int32_t id;
  };
  // Splits `text` on raw (non-normalized) or on normalized added tokens.
  void FindSplits(std::string_view text, bool normalized, std::vector<TextSplit>* out) const;
  bool HasRaw() const { return !raw_.empty(); }
  bool HasNormalized() const { return !normalized_.empty(); }

  const AddedToken* ById(int32_t id) const {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : &tokens_[it->second];
  }
  std::optional<int32_t> ByContent(std::string_view s) const {
    auto it = by_content_.find(absl::string_view(s.data(), s.size()));
    if (it == by_content_.end()) return std::nullopt;
    return tokens_[it->second].id;
  }
  bool IsSpecialContent(std::string_view s) const {
    return special_contents_.contains(absl::string_view(s.data(), s.size()));
  }
  int32_t MaxId() const { return max_id_; }

 private:
  // A byte trie over the patterns, for leftmost-longest search.
  struct Matcher {
    struct Node {
      absl::flat_hash_map<unsigned char, int32_t> next;
      int32_t token = -1;  // index into tokens_
    };
    std::vector<Node> nodes{Node{}};
    std::array<bool, 256> first_byte{};
    void Add(std::string_view pattern, int32_t token);
    bool empty() const { return nodes.size() == 1; }
  };
  void SplitOn(const Matcher& m, PreTokenizedString::Piece& piece,
               std::vector<PreTokenizedString::Piece>* out) const;
  void FindSplitsWith(const Matcher& m, std::string_view s, std::vector<TextSplit>* out) const;

  std::vector<AddedToken> tokens_;
  absl::flat_hash_map<int32_t, size_t> by_id_;
  absl::flat_hash_map<std::string, size_t> by_content_;
  absl::flat_hash_set<std::string> special_contents_;
  Matcher raw_;
  Matcher normalized_;
  int32_t max_id_ = -1;
};

}  // namespace tgis::tok

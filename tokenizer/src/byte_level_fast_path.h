// A faster route through the most common pipelines (GPT-2, GPT-NeoX, StarCoder, BLOOM,
// Llama 3, Qwen2: optional NFC, regex/digit splits, then ByteLevel last) that works on byte
// ranges of the input instead of NormalizedStrings. It reproduces the general pipeline's ids
// and offsets exactly (the oracle tests run through it), and declines texts it cannot handle.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "tokenizer/src/added_vocabulary.h"
#include "tokenizer/src/pattern.h"
#include "tokenizer/src/pipeline.h"

namespace tgis::tok {

class ByteLevelFastPath {
 public:
  // Null when the tokenizer.json pipeline is not one this path reproduces.
  static std::unique_ptr<ByteLevelFastPath> Build(const Json& root);
  // False when this text must take the general path (NFC configured and text not in NFC).
  bool Applicable(std::string_view text) const;
  absl::Status Encode(std::string_view text, const AddedVocabulary& added, const Model& model,
                      RawEncoding* out) const;

 private:
  struct Stage {
    std::unique_ptr<Pattern> pattern;  // null: a digits stage
    SplitBehavior behavior;
  };
  void Split(std::string_view text, size_t base, size_t stage,
             std::vector<std::pair<size_t, size_t>>* out) const;

  bool nfc_ = false;
  std::vector<Stage> stages_;
};

}  // namespace tgis::tok

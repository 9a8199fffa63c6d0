// Stop sequences are matched on the detokenized text, not on tokens, so that "Pari" stops a
// request whether the model wrote it as one token or as "P" + "ari". The matcher also decides
// which text is final: text that might be the start of a stop sequence is held back until the
// next tokens settle it, so that streamed pieces never have to be taken back.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tgis::router {

class StopSequenceMatcher {
 public:
  // `include_stop_sequence`: whether a matched sequence stays in the output (the text after
  // it is dropped either way).
  StopSequenceMatcher(std::vector<std::string> stop_sequences, bool include_stop_sequence);

  struct Result {
    std::string released;         // text that is now final, to append to the output
    std::optional<size_t> match;  // index of the stop sequence that matched
  };

  // Adds newly decoded text. When `may_stop`, a stop sequence that ends inside `text` (it may
  // start in earlier, held-back text) ends the output: `released` then stops at the cut and
  // the matcher takes no more text. When several match, the first in the request's order wins,
  // at its last occurrence in the new text (TGIS's rule). Without `may_stop` (e.g. before
  // min_new_tokens), nothing matches, as in TGIS, where a stop sequence must end in the text of the
  // token that stops the request.
  Result Append(std::string_view text, bool may_stop);

  // Releases whatever is held back: the request ended for another reason.
  std::string Flush();

  bool matched() const { return matched_; }

 private:
  // Where the longest suffix of window_ that is a proper prefix of a stop sequence starts
  // (window_.size() when there is none).
  size_t PartialMatchStart() const;

  std::vector<std::string> stop_sequences_;
  bool include_;
  size_t longest_ = 0;  // bytes of the longest stop sequence
  // The end of the output: the text not yet released, after enough released text for a stop
  // sequence to match across it.
  std::string window_;
  size_t unreleased_ = 0;  // bytes at the end of window_ not yet released
  bool matched_ = false;
};

}  // namespace tgis::router

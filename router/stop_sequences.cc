#include "router/stop_sequences.h"

#include <algorithm>

namespace tgis::router {

StopSequenceMatcher::StopSequenceMatcher(std::vector<std::string> stop_sequences,
                                         bool include_stop_sequence)
    : stop_sequences_(std::move(stop_sequences)), include_(include_stop_sequence) {
  for (const std::string& s : stop_sequences_) longest_ = std::max(longest_, s.size());
}

size_t StopSequenceMatcher::PartialMatchStart() const {
  size_t start = window_.size();
  const std::string_view w(window_);
  for (const std::string& s : stop_sequences_) {
    // Only a longer partial match than the best so far can move the start back.
    const size_t best = window_.size() - start;
    for (size_t k = std::min(s.size() - 1, w.size()); k > best; --k) {
      if (w.substr(w.size() - k) == std::string_view(s).substr(0, k)) {
        start = w.size() - k;
        break;
      }
    }
  }
  return start;
}

StopSequenceMatcher::Result StopSequenceMatcher::Append(std::string_view text, bool may_stop) {
  Result result;
  if (matched_) return result;
  if (stop_sequences_.empty()) {
    result.released = std::string(text);
    return result;
  }
  const size_t old_size = window_.size();
  window_.append(text);
  unreleased_ += text.size();
  const size_t released_end = window_.size() - unreleased_;

  if (may_stop) {
    // As TGIS: the first sequence, in the request's order, that ends in the new text wins,
    // at its last occurrence there.
    size_t best_start = std::string::npos;
    size_t best_len = 0;
    for (size_t i = 0; i < stop_sequences_.size(); ++i) {
      const std::string& s = stop_sequences_[i];
      const size_t from = old_size + 1 > s.size() ? old_size + 1 - s.size() : 0;
      const size_t pos = window_.rfind(s);
      if (pos == std::string::npos || pos < from) continue;
      best_start = pos;
      best_len = s.size();
      result.match = i;
      break;
    }
    if (result.match.has_value()) {
      // Held-back text covers any excluded sequence's start, so the cut is never in text
      // already released; max() only guards that invariant.
      const size_t cut = std::max(include_ ? best_start + best_len : best_start, released_end);
      result.released = window_.substr(released_end, cut - released_end);
      window_.clear();
      unreleased_ = 0;
      matched_ = true;
      return result;
    }
  }

  // An included stop sequence may go out piece by piece: whatever follows it is cut when it
  // completes. An excluded one may not, so a possible start of one is held back.
  const size_t hold_from = include_ ? window_.size() : PartialMatchStart();
  const size_t new_released_end = std::max(released_end, hold_from);
  result.released = window_.substr(released_end, new_released_end - released_end);
  unreleased_ = window_.size() - new_released_end;
  // Keep just enough released text for a match that starts in it and ends in later text.
  const size_t context = longest_ > 0 ? longest_ - 1 : 0;
  if (new_released_end > context) window_.erase(0, new_released_end - context);
  return result;
}

std::string StopSequenceMatcher::Flush() {
  std::string out = window_.substr(window_.size() - unreleased_);
  window_.clear();
  unreleased_ = 0;
  return out;
}

}  // namespace tgis::router

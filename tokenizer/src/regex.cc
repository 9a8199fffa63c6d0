#include "tokenizer/src/regex.h"

#include <oniguruma.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "tokenizer/src/unicode.h"

namespace tgis::tok {
namespace {
void InitOnigOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encs[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encs, 1);
  });
}

struct RegionDeleter {
  void operator()(OnigRegion* r) const { onig_region_free(r, 1); }
};
}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  InitOnigOnce();
  OnigRegex reg = nullptr;
  OnigErrorInfo einfo;
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  int r = onig_new(&reg, p, p + pattern.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8,
                   ONIG_SYNTAX_RUBY, &einfo);
  if (r != ONIG_NORMAL) {
    OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(msg, r, &einfo);
    return absl::InvalidArgumentError(
        absl::StrCat("invalid regex '", std::string(pattern), "': ", reinterpret_cast<char*>(msg)));
  }
  std::unique_ptr<Regex> out(new Regex());
  out->regex_ = reg;
  out->pattern_ = std::string(pattern);
  return out;
}

Regex::~Regex() {
  if (regex_ != nullptr) onig_free(static_cast<OnigRegex>(regex_));
}

void Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  thread_local std::unique_ptr<OnigRegion, RegionDeleter> region(onig_region_new());
  auto reg = static_cast<OnigRegex>(regex_);
  const auto* begin = reinterpret_cast<const OnigUChar*>(text.data());
  const auto* end = begin + text.size();
  size_t last_end = 0;
  bool have_last_match = false;
  size_t last_match_end = 0;
  while (last_end <= text.size()) {
    onig_region_clear(region.get());
    int r = onig_search(reg, begin, end, begin + last_end, end, region.get(), ONIG_OPTION_NONE);
    if (r < 0) break;
    size_t s = region->beg[0], e = region->end[0];
    if (e == s && have_last_match && last_match_end == e) {
      last_end +=
          last_end < text.size() ? Utf8SeqLen(static_cast<unsigned char>(text[last_end])) : 1;
      continue;
    }
    last_end = e;
    have_last_match = true;
    last_match_end = e;
    out->emplace_back(s, e);
  }
}

std::vector<MatchSpan> Regex::FindMatches(std::string_view text) const {
  std::vector<MatchSpan> out;
  if (text.empty()) {
    out.push_back({0, 0, false});
    return out;
  }
  std::vector<std::pair<size_t, size_t>> found;
  FindAll(text, &found);
  size_t prev = 0;
  for (auto [s, e] : found) {
    if (prev != s) out.push_back({prev, s, false});
    out.push_back({s, e, true});
    prev = e;
  }
  if (prev != text.size()) out.push_back({prev, text.size(), false});
  return out;
}

}  // namespace tgis::tok

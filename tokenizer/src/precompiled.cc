#include "tokenizer/src/precompiled.h"

#include <cstring>

namespace tgis::tok {

absl::StatusOr<std::string> Base64Decode(std::string_view in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  out.reserve(in.size() * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=' || c == '\n' || c == '\r') continue;
    int v = val(c);
    if (v < 0) return absl::InvalidArgumentError("invalid base64 character");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

absl::StatusOr<PrecompiledCharsMap> PrecompiledCharsMap::Parse(std::string_view blob) {
  PrecompiledCharsMap m;
  if (blob.empty()) return m;
  if (blob.size() < 4) return absl::InvalidArgumentError("precompiled_charsmap is truncated");
  uint32_t trie_size;
  std::memcpy(&trie_size, blob.data(), 4);
  if (trie_size % 4 != 0 || 4 + static_cast<size_t>(trie_size) > blob.size()) {
    return absl::InvalidArgumentError("precompiled_charsmap has an invalid trie size");
  }
  m.trie_.resize(trie_size / 4);
  std::memcpy(m.trie_.data(), blob.data() + 4, trie_size);
  m.normalized_ = std::string(blob.substr(4 + trie_size));
  return m;
}

std::optional<std::string_view> PrecompiledCharsMap::Transform(std::string_view chunk) const {
  if (trie_.empty()) return std::nullopt;
  auto has_leaf = [](uint32_t u) { return ((u >> 8) & 1) == 1; };
  auto value = [](uint32_t u) { return u & ((1U << 31) - 1); };
  auto label = [](uint32_t u) { return u & ((1U << 31) | 0xFF); };
  auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1U << 9)) >> 6); };
  size_t node = 0;
  uint32_t unit = trie_[node];
  node ^= offset(unit);
  for (char ch : chunk) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0) break;
    node ^= c;
    if (node >= trie_.size()) return std::nullopt;
    unit = trie_[node];
    if (label(unit) != c) return std::nullopt;
    node ^= offset(unit);
    if (node >= trie_.size()) return std::nullopt;
    if (has_leaf(unit)) {
      size_t index = value(trie_[node]);
      if (index >= normalized_.size()) return std::nullopt;
      size_t end = normalized_.find('\0', index);
      if (end == std::string::npos) end = normalized_.size();
      return std::string_view(normalized_).substr(index, end - index);
    }
  }
  return std::nullopt;
}

}  // namespace tgis::tok

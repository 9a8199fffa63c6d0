#include "server/block_cache.h"

#include <algorithm>

namespace tgis::server {

namespace {
constexpr BlockCache::Node kPlainRoot = 1;
}  // namespace

size_t BlockCache::KeyHash::operator()(const Key& k) const {
  // FNV-1a over the parent and the tokens; equality of the whole key decides a match, so a
  // collision costs a probe, never a wrong block.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(k.parent);
  for (int32_t t : k.tokens) mix(static_cast<uint32_t>(t));
  return static_cast<size_t>(h);
}

BlockCache::BlockCache(int num_blocks, int block_size, bool caching)
    : block_size_(block_size), caching_(caching), blocks_(static_cast<size_t>(num_blocks)) {
  free_.reserve(blocks_.size());
  // Hand out low block numbers first (pop from the back).
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

std::optional<int32_t> BlockCache::Allocate() {
  if (free_.empty()) {
    if (lru_.empty()) return std::nullopt;
    Evict(lru_.front());
  }
  const int32_t b = free_.back();
  free_.pop_back();
  blocks_[b].refs = 1;
  return b;
}

void BlockCache::Evict(int32_t block) {
  BlockState& s = blocks_[block];
  lru_.erase(*s.lru);
  s.lru.reset();
  index_.erase(*s.key);
  s.key.reset();
  s.node = 0;
  free_.push_back(block);
}

void BlockCache::Release(int32_t block) {
  BlockState& s = blocks_[block];
  if (--s.refs > 0) return;
  if (s.key.has_value()) {
    s.lru = lru_.insert(lru_.end(), block);
  } else {
    free_.push_back(block);
  }
}

BlockCache::Node BlockCache::Root(const std::shared_ptr<const void>& prefix) {
  if (!prefix) return kPlainRoot;
  auto it = roots_.find(prefix.get());
  if (it != roots_.end()) {
    // Alive: the same object, so the same vectors. Expired: another object now at its address.
    if (!it->second.prefix.expired()) return it->second.node;
    roots_.erase(it);
  }
  std::erase_if(roots_, [](const auto& entry) { return entry.second.prefix.expired(); });
  const Node node = next_node_++;
  roots_.emplace(prefix.get(), RootEntry{prefix, node});
  return node;
}

std::vector<int32_t> BlockCache::Match(Node root, std::span<const int32_t> tokens,
                                       size_t max_blocks, Node* last) {
  std::vector<int32_t> found;
  *last = root;
  if (!caching_) return found;
  const size_t bs = static_cast<size_t>(block_size_);
  Key key{root, {}};
  while (found.size() < max_blocks && (found.size() + 1) * bs <= tokens.size()) {
    key.tokens.assign(tokens.begin() + found.size() * bs, tokens.begin() + (found.size() + 1) * bs);
    auto it = index_.find(key);
    if (it == index_.end()) break;
    BlockState& s = blocks_[it->second];
    if (s.refs++ == 0) {
      lru_.erase(*s.lru);
      s.lru.reset();
    }
    found.push_back(it->second);
    key.parent = s.node;
  }
  *last = key.parent;
  return found;
}

BlockCache::Node BlockCache::Register(Node parent, std::span<const int32_t> tokens, int32_t block) {
  if (!caching_) return 0;
  Key key{parent, std::vector<int32_t>(tokens.begin(), tokens.end())};
  auto it = index_.find(key);
  if (it != index_.end()) return blocks_[it->second].node;
  BlockState& s = blocks_[block];
  if (s.key.has_value()) return s.node;  // registered already (under its first content)
  s.node = next_node_++;
  s.key = key;
  index_.emplace(std::move(key), block);
  return s.node;
}

}  // namespace tgis::server

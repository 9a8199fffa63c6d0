// The KV cache's blocks and what they hold (prefix caching). A block is private to one sequence
// until it is full; a full block can then be registered under its content, which is its
// tokens and everything before them (the node of the block before it), so that a later
// sequence starting with the same tokens takes the block instead of computing it again.
// Registered blocks are reference-counted; when no sequence holds one it stays cached, and
// is evicted (least recently used first) only when a fresh block is needed and none is free.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace tgis::server {

class BlockCache {
 public:
  // A registered block's content: a chain of nodes from a root. Node ids are never reused, so
  // a node whose block was evicted can never be matched again, nor anything after it.
  using Node = uint64_t;

  // `caching` off: blocks are never registered, Match finds nothing.
  BlockCache(int num_blocks, int block_size, bool caching);

  // A block for one sequence's own use (one reference), evicting the least recently used
  // cached block when none is free; nullopt when every block is in use.
  std::optional<int32_t> Allocate();
  // Drops one reference to `block`. An unregistered block is free at once; a registered one
  // stays cached until evicted. Release a sequence's blocks last to first: the blocks at the
  // start of a prompt, the ones most worth keeping, then go last.
  void Release(int32_t block);

  // The root node of sequences that start with the given virtual-token prefix (prompt tuning:
  // identified by the object that holds its vectors; nullptr: none). A prefix that is gone has
  // no cached blocks any more, even if another takes its place in memory.
  Node Root(const std::shared_ptr<const void>& prefix);
  // The longest chain of cached blocks holding `tokens` from the start, whole blocks only and
  // at most `max_blocks`; each block returned gets a reference. `*last` is the node of the last
  // block found (`root` when none).
  std::vector<int32_t> Match(Node root, std::span<const int32_t> tokens, size_t max_blocks,
                             Node* last);
  // Registers `block` (full, held by the caller) as holding `tokens` (block_size of them)
  // after `parent`, and returns the node to chain the next block to. When that content is
  // cached already in another block, the other block's node comes back and `block` stays
  // private (it is freed when released).
  Node Register(Node parent, std::span<const int32_t> tokens, int32_t block);

  bool caching() const { return caching_; }
  int block_size() const { return block_size_; }
  int total() const { return static_cast<int>(blocks_.size()); }
  // Blocks that Allocate can still hand out: free ones and cached ones nobody holds.
  int available() const { return static_cast<int>(free_.size() + lru_.size()); }
  // Registered blocks (held or not).
  int cached() const { return static_cast<int>(index_.size()); }

 private:
  struct Key {
    Node parent;
    std::vector<int32_t> tokens;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct BlockState {
    int refs = 0;
    std::optional<Key> key;                           // registered: its content
    Node node = 0;                                    // registered: its node
    std::optional<std::list<int32_t>::iterator> lru;  // cached and held by nobody
  };

  void Evict(int32_t block);

  int block_size_;
  bool caching_;
  std::vector<BlockState> blocks_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // cached blocks nobody holds, least recently used first
  std::unordered_map<Key, int32_t, KeyHash> index_;
  struct RootEntry {
    std::weak_ptr<const void> prefix;
    Node node;
  };
  std::unordered_map<const void*, RootEntry> roots_;
  Node next_node_ = 2;  // 1: the root of sequences without a prefix
};

}  // namespace tgis::server

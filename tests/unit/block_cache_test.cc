// BlockCache: allocation, reference counts, registration by content, matching, and eviction
// of cached blocks nobody holds, least recently used first.
#include "server/block_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace {

using tgis::server::BlockCache;

// Registers `blocks` as holding `tokens` (block_size each) from `root`; returns the last node.
BlockCache::Node RegisterChain(BlockCache& cache, BlockCache::Node root,
                               const std::vector<int32_t>& tokens,
                               const std::vector<int32_t>& blocks) {
  BlockCache::Node node = root;
  const size_t bs = static_cast<size_t>(cache.block_size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    node = cache.Register(node, std::span<const int32_t>(tokens).subspan(i * bs, bs), blocks[i]);
  }
  return node;
}

std::vector<int32_t> AllocateN(BlockCache& cache, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    auto b = cache.Allocate();
    EXPECT_TRUE(b.has_value());
    out.push_back(*b);
  }
  return out;
}

TEST(BlockCache, AllocatesEveryBlockOnceThenRunsOut) {
  BlockCache cache(3, 4, true);
  std::vector<int32_t> got = AllocateN(cache, 3);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(cache.Allocate().has_value());
  EXPECT_EQ(cache.available(), 0);
  cache.Release(1);
  EXPECT_EQ(cache.available(), 1);
  EXPECT_EQ(cache.Allocate(), 1);
}

TEST(BlockCache, ARegisteredBlockIsFoundByItsTokensAndWhatCameBefore) {
  BlockCache cache(8, 2, true);
  const BlockCache::Node root = cache.Root(nullptr);
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  std::vector<int32_t> blocks = AllocateN(cache, 2);
  RegisterChain(cache, root, tokens, blocks);
  for (int32_t b : blocks) cache.Release(b);
  EXPECT_EQ(cache.available(), 8);  // cached blocks nobody holds can be handed out

  BlockCache::Node last = 0;
  std::vector<int32_t> found = cache.Match(root, tokens, 10, &last);
  EXPECT_EQ(found, blocks);
  EXPECT_NE(last, root);
  // Each block found is held again: it cannot be evicted under the new holder.
  EXPECT_EQ(cache.available(), 6);
  for (int32_t b : found) cache.Release(b);

  // At most max_blocks; whole blocks only; the same tokens at another place do not match.
  EXPECT_EQ(cache.Match(root, tokens, 1, &last).size(), 1u);
  cache.Release(blocks[0]);
  EXPECT_EQ(cache.Match(root, std::vector<int32_t>{5}, 10, &last).size(), 0u);
  EXPECT_EQ(last, root);
  EXPECT_EQ(cache.Match(root, std::vector<int32_t>{7, 8, 5, 6}, 10, &last).size(), 0u);
  // A different first block: the second, though its own tokens agree, is not reached.
  EXPECT_EQ(cache.Match(root, std::vector<int32_t>{5, 0, 7, 8}, 10, &last).size(), 0u);
}

TEST(BlockCache, PromptTuningPrefixesHaveTheirOwnRoots) {
  BlockCache cache(8, 2, true);
  auto prefix_a = std::make_shared<int>(1);
  auto prefix_b = std::make_shared<int>(2);
  const BlockCache::Node a = cache.Root(prefix_a);
  EXPECT_EQ(cache.Root(prefix_a), a);
  EXPECT_NE(cache.Root(prefix_b), a);
  EXPECT_NE(cache.Root(nullptr), a);

  const std::vector<int32_t> tokens = {0, 0, 3, 4};
  std::vector<int32_t> blocks = AllocateN(cache, 2);
  RegisterChain(cache, a, tokens, blocks);
  for (int32_t b : blocks) cache.Release(b);
  BlockCache::Node last = 0;
  EXPECT_EQ(cache.Match(cache.Root(prefix_b), tokens, 10, &last).size(), 0u);
  EXPECT_EQ(cache.Match(cache.Root(nullptr), tokens, 10, &last).size(), 0u);
  std::vector<int32_t> found = cache.Match(a, tokens, 10, &last);
  EXPECT_EQ(found.size(), 2u);
  for (int32_t b : found) cache.Release(b);

  // A prefix that is gone: whatever object comes next gets a new root, even at its address.
  const void* address = prefix_a.get();
  prefix_a.reset();
  auto again = std::shared_ptr<const void>(address, [](const void*) {});
  EXPECT_NE(cache.Root(again), a);
}

TEST(BlockCache, SameContentTwiceKeepsTheFirstBlock) {
  BlockCache cache(4, 2, true);
  const BlockCache::Node root = cache.Root(nullptr);
  const std::vector<int32_t> tokens = {1, 2};
  const int32_t first = *cache.Allocate();
  const int32_t second = *cache.Allocate();
  const BlockCache::Node n1 = cache.Register(root, tokens, first);
  EXPECT_EQ(cache.Register(root, tokens, second), n1);
  EXPECT_EQ(cache.cached(), 1);
  cache.Release(second);  // unregistered: free at once
  cache.Release(first);   // registered: cached
  EXPECT_EQ(cache.cached(), 1);
  BlockCache::Node last = 0;
  EXPECT_EQ(cache.Match(root, tokens, 1, &last), std::vector<int32_t>{first});
}

TEST(BlockCache, EvictsLeastRecentlyUsedAndForgetsWhatFollowedIt) {
  BlockCache cache(3, 1, true);
  const BlockCache::Node root = cache.Root(nullptr);
  // Chain 10 -> 11, released last to first (11 goes before 10 into the LRU order), and a
  // single block 20 released after them.
  std::vector<int32_t> chain = AllocateN(cache, 2);
  RegisterChain(cache, root, {10, 11}, chain);
  cache.Release(chain[1]);
  cache.Release(chain[0]);
  const int32_t single = *cache.Allocate();
  cache.Register(root, std::vector<int32_t>{20}, single);
  cache.Release(single);
  ASSERT_EQ(cache.cached(), 3);

  // The next allocation evicts the least recently released: 11.
  const int32_t taken = *cache.Allocate();
  EXPECT_EQ(taken, chain[1]);
  EXPECT_EQ(cache.cached(), 2);
  BlockCache::Node last = 0;
  EXPECT_EQ(cache.Match(root, std::vector<int32_t>{10, 11}, 10, &last).size(), 1u);
  cache.Release(chain[0]);
  // Held blocks are never evicted; a match moves a block to the back of the LRU order.
  std::vector<int32_t> held = cache.Match(root, std::vector<int32_t>{20}, 10, &last);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(*cache.Allocate(), chain[0]);
  EXPECT_FALSE(cache.Allocate().has_value());
  cache.Release(held[0]);
  cache.Release(taken);

  // A block registered after an evicted one is never matched, even when a new block takes
  // the evicted one's content: node ids are not reused.
  BlockCache small(4, 1, true);
  const BlockCache::Node r = small.Root(nullptr);
  std::vector<int32_t> ab = AllocateN(small, 2);
  RegisterChain(small, r, {1, 2}, ab);
  small.Release(ab[0]);  // the first block goes into the LRU order first: evicted first
  small.Release(ab[1]);
  std::vector<int32_t> filler = AllocateN(small, 3);  // 2 free, then evicts block `1`
  EXPECT_EQ(small.cached(), 1);
  const int32_t again = filler[2];
  small.Register(r, std::vector<int32_t>{1}, again);
  small.Release(again);
  EXPECT_EQ(small.Match(r, std::vector<int32_t>{1, 2}, 10, &last), std::vector<int32_t>{again});
}

TEST(BlockCache, CachingOffRegistersNothing) {
  BlockCache cache(2, 1, false);
  const BlockCache::Node root = cache.Root(nullptr);
  const int32_t b = *cache.Allocate();
  cache.Register(root, std::vector<int32_t>{1}, b);
  cache.Release(b);
  EXPECT_EQ(cache.cached(), 0);
  BlockCache::Node last = 0;
  EXPECT_TRUE(cache.Match(root, std::vector<int32_t>{1}, 1, &last).empty());
  EXPECT_EQ(cache.available(), 2);
}

}  // namespace

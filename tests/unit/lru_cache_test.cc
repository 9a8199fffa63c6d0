// common/lru_cache.h: recency order, eviction by total cost, the eviction callback.
#include "common/lru_cache.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tgis {
namespace {

TEST(LruCache, EvictsTheLeastRecentlyUsedByCount) {
  LruCache<int> cache(2);
  cache.Insert("a", 1);
  cache.Insert("b", 2);
  ASSERT_NE(cache.Find("a"), nullptr);  // "b" is now the least recently used
  cache.Insert("c", 3);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.Find("b"), nullptr);
  ASSERT_NE(cache.Find("a"), nullptr);
  EXPECT_EQ(*cache.Find("a"), 1);
  ASSERT_NE(cache.Find("c"), nullptr);
  EXPECT_EQ(*cache.Find("c"), 3);
}

TEST(LruCache, EvictsByCostUntilTheNewEntryFits) {
  LruCache<int> cache(10);
  std::vector<std::string> evicted;
  auto note = [&](const std::string& key, const int&, double) { evicted.push_back(key); };
  cache.Insert("a", 1, 4, note);
  cache.Insert("b", 2, 4, note);
  cache.Insert("c", 3, 2, note);  // exactly full
  EXPECT_TRUE(evicted.empty());
  EXPECT_DOUBLE_EQ(cache.total_cost(), 10);
  cache.Find("a");
  cache.Insert("d", 4, 5, note);  // b (4) then c (2) make room; a was used last
  EXPECT_EQ(evicted, (std::vector<std::string>{"b", "c"}));
  EXPECT_DOUBLE_EQ(cache.total_cost(), 9);
  EXPECT_NE(cache.Find("a"), nullptr);
  EXPECT_NE(cache.Find("d"), nullptr);
}

TEST(LruCache, KeepsAnEntryLargerThanTheCapacityAlone) {
  LruCache<int> cache(3);
  cache.Insert("a", 1);
  cache.Insert("big", 2, 5);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_NE(cache.Find("big"), nullptr);
}

TEST(LruCache, ClearEmptiesIt) {
  LruCache<int> cache(4);
  cache.Insert("a", 1, 2);
  cache.Clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.total_cost(), 0);
  EXPECT_EQ(cache.Find("a"), nullptr);
}

}  // namespace
}  // namespace tgis

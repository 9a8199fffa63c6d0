// A least-recently-used map bounded by the total cost of its entries (a count, when each costs 1;
// MiB, when each costs its size). One implementation for the caches the router and the shards
// keep (compiled guided-decoding automata, prompt-tuning prefixes and LoRA adapters). Not
// thread-safe: its owner holds its own lock, since what it does around a miss (load outside the
// lock, check again) is its own.
#pragma once

#include <cstddef>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>

namespace tgis {

template <typename Value, typename Key = std::string>
class LruCache {
 public:
  explicit LruCache(double capacity) : capacity_(capacity) {}

  // The value for `key`, which becomes the most recently used; null when absent.
  Value* Find(const Key& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->value;
  }

  // Adds `key` (absent) as the most recently used, first evicting the least recently used
  // entries until the total cost leaves room for `cost` (an entry costing more than the
  // capacity is kept alone). `on_evict(key, value, cost)` sees each entry evicted.
  template <typename OnEvict>
  Value& Insert(Key key, Value value, double cost, OnEvict on_evict) {
    while (!order_.empty() && total_ + cost > capacity_) {
      Entry& last = order_.back();
      on_evict(last.key, last.value, last.cost);
      total_ -= last.cost;
      index_.erase(last.key);
      order_.pop_back();
    }
    order_.push_front(Entry{key, std::move(value), cost});
    index_[std::move(key)] = order_.begin();
    total_ += cost;
    return order_.front().value;
  }
  Value& Insert(Key key, Value value, double cost = 1) {
    return Insert(std::move(key), std::move(value), cost, [](const Key&, const Value&, double) {});
  }

  void Clear() {
    index_.clear();
    order_.clear();
    total_ = 0;
  }
  size_t size() const { return order_.size(); }
  double total_cost() const { return total_; }
  double capacity() const { return capacity_; }

 private:
  struct Entry {
    Key key;
    Value value;
    double cost;
  };
  double capacity_;
  double total_ = 0;
  std::list<Entry> order_;  // most recently used first
  std::unordered_map<Key, typename std::list<Entry>::iterator> index_;
};

}  // namespace tgis

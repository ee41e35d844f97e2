// dest feed: a load's destinations handed to its plan as load_dests finds
// them. The plan's pass over the destinations (its scatter runs) then runs on
// the planning thread beside load_dests, each tensor read while load_dests has
// just brought it into the cache, instead of after it, when each tensor's first
// touch is a cache miss again. Only the usual load takes it: every checkpoint
// tensor one unit, in table order, each value a tensor of its own (state_dict.py
// checks that once load_dests is done, and otherwise closes the feed unused and
// plans without it).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "copy_table.h"
#include "plan.h"

namespace coalesced_bcast {

class DestFeed {
 public:
  using Meta = std::array<int64_t, 1 + kMaxDims>;
  // At most `capacity` destinations (the values load_dests reads): the slots exist before the reader
  // starts, so a put never moves one that the reader is reading.
  explicit DestFeed(int64_t capacity) : tensors_(capacity), meta_(capacity) {}
  DestFeed(const DestFeed&) = delete;
  DestFeed& operator=(const DestFeed&) = delete;

  // The writer (load_dests, one thread): the next destination.
  void put(const at::Tensor& t, const Meta& m) {
    const int64_t i = count_.load(std::memory_order_relaxed);
    TORCH_CHECK(i < static_cast<int64_t>(tensors_.size()), "a dest feed of ", tensors_.size(), " got more");
    tensors_[i] = t;
    meta_[i] = m;
    count_.store(i + 1, std::memory_order_release);
  }
  // A destination already put was changed after (a tensor named by two keys): the plan cannot use the feed.
  void spoil() { spoiled_.store(true, std::memory_order_relaxed); }
  // No more destinations; `use`: whether the plan is wanted (load_dests found nothing wrong and the load
  // is the usual one). Idempotent: the first call counts.
  void close(bool use) {
    int expected = kOpen;
    state_.compare_exchange_strong(expected, use && !spoiled_.load(std::memory_order_relaxed) ? kUsed : kDropped,
                                   std::memory_order_release);
  }
  bool closed() const { return state_.load(std::memory_order_acquire) != kOpen; }
  bool used() const { return state_.load(std::memory_order_acquire) == kUsed; }
  bool dropped() const { return state_.load(std::memory_order_relaxed) == kDropped; }

  // The reader (the planning thread): waits until destination i is there (true) or the feed is closed
  // before it (false: there are i in all, or the feed was dropped).
  bool wait(int64_t i);
  const at::Tensor& tensor(int64_t i) const { return tensors_[i]; }
  const int64_t* meta(int64_t i) const { return meta_[i].data(); }
  // The first n destinations, taken out (the plan keeps them); the others let go.
  std::vector<at::Tensor> take(int64_t n) {
    tensors_.resize(n);
    return std::move(tensors_);
  }
  // Every destination put, taken out: a feed closed unused, its reader done (the plan is then made from them).
  std::vector<at::Tensor> take_put() { return take(count_.load(std::memory_order_acquire)); }

 private:
  enum { kOpen = 0, kUsed = 1, kDropped = 2 };
  std::vector<at::Tensor> tensors_;
  std::vector<Meta> meta_;
  std::atomic<int64_t> count_{0};
  std::atomic<int> state_{kOpen};
  std::atomic<bool> spoiled_{false};
};

// make_load_plan (plan.h) with the destinations and their meta taken from `feed` as load_dests puts them,
// the units the table's rows in order; the source's pack runs are made meanwhile. None where the feed is
// closed unused.
std::optional<Plan> make_fed_load_plan(
    const at::Tensor& units,
    std::vector<at::Tensor> sources,
    DestFeed& feed,
    const LoadOptions& options);

}  // namespace coalesced_bcast

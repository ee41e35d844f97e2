// IdSet: the ids (addresses) of a model's parameters and buffers, as a load
// checks each state-dict value against them. A Python set of ints costs an
// int object per id and, per lookup, a made int, a probe and a compare that
// reads the stored int: two cache misses a key at 16k keys. Here one probe of
// a flat table, which the caller can prefetch a few keys ahead. Like a set of
// id()s it holds no reference: it is valid while the objects live.
#pragma once

#include <cstdint>
#include <vector>

namespace coalesced_bcast {

class IdSet {
 public:
  IdSet() { slots_.assign(kMinSlots, 0); }

  void add(uintptr_t id) {
    if (id == 0) return;  // no object has address 0: 0 marks an empty slot
    if (2 * (size_ + 1) > slots_.size()) grow();
    for (size_t h = home(id);; ++h) {
      auto& s = slots_[h & (slots_.size() - 1)];
      if (s == id) return;
      if (s == 0) {
        s = id;
        ++size_;
        return;
      }
    }
  }
  bool contains(uintptr_t id) const {
    if (id == 0) return false;
    for (size_t h = home(id);; ++h) {
      const auto s = slots_[h & (slots_.size() - 1)];
      if (s == id) return true;
      if (s == 0) return false;
    }
  }
  // The line where contains(id) looks first.
  void prefetch(uintptr_t id) const { __builtin_prefetch(&slots_[home(id) & (slots_.size() - 1)]); }
  size_t size() const { return size_; }
  template <typename Fn>
  void for_each(const Fn& fn) const {
    for (auto s : slots_) {
      if (s != 0) fn(s);
    }
  }

 private:
  static constexpr size_t kMinSlots = 16;
  // Objects are 16-byte aligned: the product's high bits mix all of the address.
  static size_t home(uintptr_t id) { return static_cast<size_t>((id * 0x9E3779B97F4A7C15ull) >> 24); }
  void grow() {
    std::vector<uintptr_t> old(2 * slots_.size(), 0);
    old.swap(slots_);
    size_ = 0;
    for (auto s : old) {
      if (s != 0) add(s);
    }
  }

  std::vector<uintptr_t> slots_;
  size_t size_ = 0;
};

}  // namespace coalesced_bcast

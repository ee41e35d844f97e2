// IdTable: objects by id (address), open addressing in one allocation, as a
// load looks each state-dict value up: IdSet, the ids of a model's parameters
// and buffers; IdTable<size_t>, each value's destination (load_dests.cpp). A
// Python set of ints costs an int object per id and, per lookup, a made int, a
// probe and a compare that reads the stored int: two cache misses a key at 16k
// keys; a std::unordered_map allocates a node per entry, another miss. Here one
// probe of a flat table, which the caller can prefetch a few keys ahead. Like a set of id()s
// it holds no reference: it is valid while the objects live.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace coalesced_bcast {

namespace detail {
template <typename V>
struct IdSlot {
  uintptr_t id = 0;
  V value{};
};
template <>
struct IdSlot<void> {  // a set's slot: the id alone, twice as many to a cache line
  uintptr_t id = 0;
};
}  // namespace detail

// V = void: a set of ids.
template <typename V = void>
class IdTable {
  using Slot = detail::IdSlot<V>;

 public:
  IdTable() : IdTable(0) {}
  // Room for `expected` entries before the first growth.
  explicit IdTable(size_t expected) {
    size_t cap = kMinSlots;
    while (cap < 2 * expected) cap <<= 1;
    slots_.assign(cap, Slot{});
  }

  // A set's add; true where it was not there.
  bool add(uintptr_t id) {
    if (id == 0) return false;  // no object has address 0: 0 marks an empty slot
    Slot& s = claim(id);
    if (s.id == id) return false;
    s.id = id;
    ++size_;
    return true;
  }
  // A map's (the value stored for id, false), or (fresh, true) having stored it.
  template <typename W = V>
  std::pair<W, bool> find_or_add(uintptr_t id, W fresh) {
    Slot& s = claim(id);
    if (s.id == id) return {s.value, false};
    s.id = id;
    s.value = fresh;
    ++size_;
    return {fresh, true};
  }
  bool contains(uintptr_t id) const { return id != 0 && slot(id).id == id; }
  // The line where a lookup of id looks first.
  void prefetch(uintptr_t id) const { __builtin_prefetch(&slots_[home(id) & (slots_.size() - 1)]); }
  size_t size() const { return size_; }
  // fn(id) for each id, in no order.
  template <typename Fn>
  void for_each(const Fn& fn) const {
    for (const auto& s : slots_) {
      if (s.id != 0) fn(s.id);
    }
  }

 private:
  static constexpr size_t kMinSlots = 16;
  // Objects are 16-byte aligned: the product's high bits mix all of the address.
  static size_t home(uintptr_t id) { return static_cast<size_t>((id * 0x9E3779B97F4A7C15ull) >> 24); }
  // id's slot, or the empty one where it would go.
  const Slot& slot(uintptr_t id) const {
    for (size_t h = home(id);; ++h) {
      const Slot& s = slots_[h & (slots_.size() - 1)];
      if (s.id == id || s.id == 0) return s;
    }
  }
  // The same, with room kept for one more entry.
  Slot& claim(uintptr_t id) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    return const_cast<Slot&>(slot(id));
  }
  void grow() {
    std::vector<Slot> old(2 * slots_.size(), Slot{});
    old.swap(slots_);
    for (const auto& s : old) {
      if (s.id != 0) const_cast<Slot&>(slot(s.id)) = s;
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

using IdSet = IdTable<>;

}  // namespace coalesced_bcast

// chunks: a per-tensor pass over many tensors (planning, a kept plan's check)
// spread over torch's inter-op threads, and the prefetch that keeps one
// thread's pass from waiting on each TensorImpl in turn.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace coalesced_bcast {

// Below about this many tensors per chunk a thread's wake-up costs more than it
// saves (a kept plan's check; planning passes its own, larger grain: plan.cpp).
constexpr int64_t kChunkGrain = 2048;
constexpr int64_t kMaxChunks = 8;

// False in a process forked from one that loaded this module (chunks.cpp).
bool pool_usable();

// fn(begin, end) over [0, n) in contiguous chunks: the calling thread takes the
// first, torch's inter-op threads the others (torchrun leaves one intra-op
// thread per process, so at::parallel_for would run serially exactly here).
// fn must not throw: a chunk records what it finds and the caller acts on it.
template <typename Fn>
void for_chunks(int64_t n, const Fn& fn, int64_t grain = kChunkGrain) {
  const int64_t chunks = std::min<int64_t>({kMaxChunks, n / grain, static_cast<int64_t>(at::get_num_interop_threads()) + 1});
  if (chunks <= 1 || !pool_usable()) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + chunks - 1) / chunks;
  std::atomic<int64_t> left{chunks - 1};
  std::mutex mu;
  std::condition_variable done;
  for (int64_t c = 1; c < chunks; ++c) {
    at::launch([&, c] {
      fn(c * per, std::min(n, (c + 1) * per));
      if (left.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mu);
        done.notify_one();
      }
    });
  }
  fn(int64_t{0}, std::min(n, per));
  std::unique_lock<std::mutex> lock(mu);
  done.wait(lock, [&] { return left.load() == 0; });  // the chunks use this frame's locals
}

// How far ahead a pass prefetches: a TensorImpl and its StorageImpl are each a
// cache miss on first touch (at 64k tensors most of a pass's time), and a few
// dozen misses in flight hide them.
constexpr int64_t kPrefetchAhead = 8;

// A TensorImpl's cache lines: the fields a pass reads (sizes, strides, dtype,
// device, storage, and the policy flags that sizes() tests, at its end) lie
// across all of it (176 bytes on torch 2.14: four lines unless 64-aligned).
inline void prefetch_impl(const c10::TensorImpl* impl) {
  const auto* p = reinterpret_cast<const char*>(impl);
  __builtin_prefetch(p);
  __builtin_prefetch(p + 64);
  __builtin_prefetch(p + 128);
  __builtin_prefetch(p + sizeof(c10::TensorImpl) - 1);
}

// A Python object's lines that an attribute read touches first: a Python
// subclass's managed dict and values pointers precede the object, a Tensor
// subclass's slots (a DTensor's _local_tensor, _spec) follow its THPVariable.
inline void prefetch_object(const void* o) {
  const auto* p = static_cast<const char*>(o);
  __builtin_prefetch(p - 32);
  __builtin_prefetch(p);
  __builtin_prefetch(p + 64);
  __builtin_prefetch(p + 128);
}

// The lines of [p + from, p + to): the few bytes of an object that a pass
// reads. Where a pass touches tens of thousands of objects, lines fetched and
// not read take the fill buffers that the next objects' misses wait for.
inline void prefetch_bytes(const void* o, int64_t from, int64_t to) {
  const auto* p = static_cast<const char*>(o);
  __builtin_prefetch(p + from);
  if ((reinterpret_cast<uintptr_t>(p + from) >> 6) != (reinterpret_cast<uintptr_t>(p + to - 1) >> 6)) {
    __builtin_prefetch(p + to - 1);
  }
}

// The TensorImpl of tensors[i + 2 * ahead], and the StorageImpl of
// tensors[i + ahead], whose TensorImpl an earlier call brought in.
inline void prefetch_ahead(const at::Tensor* tensors, int64_t i, int64_t end) {
  if (i + 2 * kPrefetchAhead < end) prefetch_impl(tensors[i + 2 * kPrefetchAhead].unsafeGetTensorImpl());
  if (i + kPrefetchAhead < end) {
    const auto& t = tensors[i + kPrefetchAhead];
    if (t.defined() && t.has_storage()) __builtin_prefetch(t.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl());
  }
}

// The lowest i in [0, n) for which ok(i) is false, or n: tensors[i] checked in
// chunks (for_chunks), prefetching, each chunk stopping at its first failure or
// once a lower one is known. ok must not throw.
template <typename Ok>
int64_t first_failing(const at::Tensor* tensors, int64_t n, const Ok& ok, int64_t grain = kChunkGrain) {
  std::atomic<int64_t> first{n};
  for_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && i < first.load(std::memory_order_relaxed); ++i) {
      prefetch_ahead(tensors, i, end);
      if (ok(i)) continue;
      int64_t seen = first.load();
      while (i < seen && !first.compare_exchange_weak(seen, i)) {
      }
      return;
    }
  }, grain);
  return first.load();
}

}  // namespace coalesced_bcast

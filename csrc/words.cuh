// Device helpers shared by the pack and scatter kernels.
#pragma once

#include <cstdint>

namespace coalesced_bcast {

// n <= 16 bytes, with the widest word that both ends and n are aligned to:
// tensors that are views at odd offsets still copy correctly, just narrower.
__device__ __forceinline__ void copy_small(uint8_t* dst, const uint8_t* src, int n) {
  const auto a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n);
  if ((a & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else if ((a & 7) == 0) {
    for (int i = 0; i < n; i += 8) *reinterpret_cast<uint64_t*>(dst + i) = *reinterpret_cast<const uint64_t*>(src + i);
  } else if ((a & 3) == 0) {
    for (int i = 0; i < n; i += 4) *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
  } else if ((a & 1) == 0) {
    for (int i = 0; i < n; i += 2) *reinterpret_cast<uint16_t*>(dst + i) = *reinterpret_cast<const uint16_t*>(src + i);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = src[i];
  }
}

// The first index in [0, n) where pred turns false (pred is true on a prefix),
// or n; called by all 32 lanes of one warp, which probe 32 entries per step.
// A block finds its first run this way before it copies: over a bucket of a
// thousand runs that is two rounds of reads of global memory while the block
// waits, where a one-thread binary search is ten dependent reads in a row.
template <class Pred>
__device__ __forceinline__ int64_t warp_partition_point(int64_t n, Pred pred) {
  const int64_t lane = threadIdx.x & 31;
  int64_t lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t idx = lo + lane * step;
    const int trues = __popc(__ballot_sync(0xffffffffu, idx < hi && pred(idx)));
    if (trues == 0) return lo;  // pred(lo) is false
    const int64_t last_true = lo + (trues - 1) * step;
    hi = min(hi, last_true + step);  // the next probe, false where it exists
    lo = last_true + 1;
  }
  return lo;
}

// Bytes [b0, b1) of src to dst by a block of kThreads threads, b1 - b0 at most
// kThreads * 16 * kUnroll, b0 a multiple of 16. Each thread loads all of its
// 16-byte words before it stores any: kUnroll reads in flight per thread, not
// one, which is what a copy of many small runs needs to keep memory busy.
template <int kThreads, int kUnroll>
__device__ __forceinline__ void copy_window(uint8_t* dst, const uint8_t* src, int64_t b0, int64_t b1) {
  if (((reinterpret_cast<uintptr_t>(dst + b0) | reinterpret_cast<uintptr_t>(src + b0)) & 15) != 0) {
    for (int64_t pos = b0 + threadIdx.x * 16; pos < b1; pos += kThreads * 16) {
      copy_small(dst + pos, src + pos, static_cast<int>(min(static_cast<int64_t>(16), b1 - pos)));
    }
    return;
  }
  uint4 v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t pos = b0 + (threadIdx.x + k * kThreads) * 16;
    v[k] = pos + 16 <= b1 ? *reinterpret_cast<const uint4*>(src + pos) : uint4{};
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t pos = b0 + (threadIdx.x + k * kThreads) * 16;
    if (pos + 16 <= b1) {
      *reinterpret_cast<uint4*>(dst + pos) = v[k];
    } else if (pos < b1) {
      copy_small(dst + pos, src + pos, static_cast<int>(b1 - pos));
    }
  }
}

}  // namespace coalesced_bcast

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

}  // namespace coalesced_bcast

// The compact metadata table that drives pack and unpack, shared by the host
// planner, the CPU copier and the CUDA kernel. Plain old data only: the same
// bytes are read on the host and, after one upload, on the device.
#pragma once

#include <cstdint>

namespace coalesced_bcast {

// Tensors whose bytes are not one contiguous run are copied element by element
// through their (collapsed) sizes and strides; more dims than this after
// collapsing is refused by the planner.
constexpr int kMaxDims = 8;

// Every packed tensor starts on this boundary in the byte stream, and buckets
// are a multiple of it, so every piece of a split tensor starts aligned too:
// the kernel moves 16-byte words and never splits an element.
constexpr int64_t kAlign = 16;

struct Layout {
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];  // in elements
  int32_t ndim;
  int32_t pad_;
};

// One run of a tensor's bytes that lives in one bucket. Runs in a bucket are
// sorted by bucket_offset and do not overlap.
struct CopyOp {
  uint64_t tensor_ptr;     // address of the tensor's first element
  int64_t tensor_offset;   // byte offset into the tensor, in logical (row-major) order
  int64_t bucket_offset;   // byte offset into the bucket; a multiple of kAlign
  int64_t nbytes;
  int32_t layout;          // -1: contiguous bytes; otherwise an index into the layouts
  int32_t elem_size;
};

static_assert(sizeof(CopyOp) == 40, "CopyOp is uploaded as raw bytes");
static_assert(sizeof(Layout) % 8 == 0, "Layout is uploaded as raw bytes");

inline int64_t align_up(int64_t n, int64_t a) {
  return (n + a - 1) / a * a;
}

}  // namespace coalesced_bcast

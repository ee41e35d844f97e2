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

// ScatterOp::box of a contiguous destination, and of a 0-dim one: torch's CPU copy_ casts a 0-dim
// tensor by its scalar conversion and any other by its vectorized one, and they differ in NaN
// encodings (float32 NaN -> bfloat16 0x7FC0 against 0xFFFF; a float16 signaling NaN into float32).
constexpr int32_t kWhole = -1;
constexpr int32_t kScalar = -2;

// A load's unpack: one run of a checkpoint tensor's elements in a bucket,
// written into the part of a destination tensor that this rank holds, cast on
// the way when the model's dtype differs. Runs may start anywhere (a shard
// boundary) and several may read the same bytes (a tensor loaded into two
// keys), so the kernel walks runs, not the bucket: each run is cut into
// chunks, one block each, and first_chunk numbers them.
// A refit reuses the run for its other cast copies, with both addresses taken
// relative to a base given at launch (Executor::copy_runs): a trainer shard
// into its chunk or the slot (source: the shard's address, base 0), a
// gathered chunk into the slot.
struct ScatterOp {
  uint64_t dst_ptr;       // the destination's first element (its local tensor)
  int64_t first;          // first element: an index into the destination (box < 0) or
                          // into the full tensor, row-major (box >= 0)
  int64_t bucket_offset;  // byte offset of that element in the bucket
  int64_t count;          // elements
  int64_t first_chunk;    // chunks of the bucket's runs before this one
  int32_t box;            // kWhole or kScalar: the destination is contiguous; else an index into the boxes
  int8_t src_type;        // c10::ScalarType of the bucket's bytes (the checkpoint's)
  int8_t dst_type;        // and of the destination
  int8_t src_size;
  int8_t dst_size;
};

// The part [lo, hi) of a full tensor of `sizes` that a destination holds (a
// DTensor shard), and the destination's strides, in elements.
struct Box {
  int64_t sizes[kMaxDims];
  int64_t lo[kMaxDims];
  int64_t hi[kMaxDims];
  int64_t strides[kMaxDims];
  int32_t ndim;
  int32_t pad_;
};

// Bucket bytes per block of the scatter kernel.
constexpr int64_t kScatterChunk = 32 << 10;

static_assert(sizeof(CopyOp) == 40, "CopyOp is uploaded as raw bytes");
static_assert(sizeof(ScatterOp) == 48, "ScatterOp is uploaded as raw bytes");
static_assert(sizeof(Box) % 8 == 0, "Box is uploaded as raw bytes");
static_assert(sizeof(Layout) % 8 == 0, "Layout is uploaded as raw bytes");

inline int64_t align_up(int64_t n, int64_t a) {
  return (n + a - 1) / a * a;
}

}  // namespace coalesced_bcast

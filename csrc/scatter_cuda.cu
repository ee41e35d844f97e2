// Cast copies on the GPU, one launch per bucket: a load's unpack (bucket ->
// this rank's shards) and a refit's pack and permute (shards -> chunk or slot,
// gathered chunks -> slot). Runs may start at any element and several may
// read the same bytes, so blocks are dealt out over runs (kScatterChunk bucket
// bytes each, found by binary search on first_chunk), not over the bucket.
// Same-dtype runs into contiguous memory move 16-byte words; casts and boxed
// (non-contiguous or partial-row) destinations go element by element.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <climits>

#include "cast.h"
#include "pack_cuda.h"
#include "words.cuh"

namespace coalesced_bcast {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) scatter_kernel(
    uintptr_t src_base,
    uintptr_t dst_base,
    const ScatterOp* __restrict__ ops,
    int64_t num_ops,
    const Box* __restrict__ boxes) {
  __shared__ int64_t index;
  const int64_t block = blockIdx.x;  // one chunk per block
  if (threadIdx.x < 32) {  // the last run whose chunks start at or before this block
    const int64_t after = warp_partition_point(num_ops, [&](int64_t k) { return ops[k].first_chunk <= block; });
    if (threadIdx.x == 0) index = after - 1;
  }
  __syncthreads();
  const ScatterOp op = ops[index];
  const int64_t ss = op.src_size, ds = op.dst_size;
  const int64_t b0 = (block - op.first_chunk) * kScatterChunk;
  const int64_t b1 = min(b0 + kScatterChunk, op.count * ss);
  const auto* src = reinterpret_cast<const uint8_t*>(src_base + op.bucket_offset);
  auto* dst = reinterpret_cast<uint8_t*>(dst_base + op.dst_ptr);
  if (op.box < 0 && op.src_type == op.dst_type) {
    copy_window<kThreads, kScatterChunk / (kThreads * kAlign)>(dst + op.first * ds, src, b0, b1);
    return;
  }
  for (int64_t e = b0 / ss + threadIdx.x; e < b1 / ss; e += kThreads) {
    int64_t off = op.first + e;
    if (op.box >= 0 && !box_offset(boxes[op.box], op.first + e, &off)) continue;
    if (op.src_type == op.dst_type) {
      copy_small(dst + off * ds, src + e * ss, static_cast<int>(ss));
    } else {
      cast_element(src + e * ss, op.src_type, dst + off * ds, op.dst_type);
    }
  }
}

}  // namespace

void launch_scatter_bucket(
    uintptr_t src_base,
    uintptr_t dst_base,
    const ScatterOp* ops,
    int64_t num_ops,
    int64_t chunks,
    const Box* boxes,
    cudaStream_t stream) {
  if (num_ops == 0) return;
  TORCH_CHECK(chunks > 0 && chunks <= INT_MAX, "a bucket of ", num_ops, " scatter runs needs ", chunks, " blocks");
  scatter_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(src_base, dst_base, ops, num_ops, boxes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace coalesced_bcast

// pack/unpack on the GPU: one launch per bucket, driven by the copy table.
// Each block owns a fixed 32 KiB window of the bucket and finds the first run
// that reaches into it (one warp's search); each thread then moves its 16-byte
// units, walking the (sorted) runs forward, eight reads in flight. Small
// tensors therefore cost no launches of their own, and large runs are copied
// with full 16-byte words.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <climits>

#include "copy_table.h"
#include "pack_cuda.h"
#include "words.cuh"

namespace coalesced_bcast {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kUnitsPerThread = 8;
constexpr int64_t kChunk = kThreads * kAlign * kUnitsPerThread;

// Element offset (in elements) of logical element e of a strided tensor.
__device__ __forceinline__ int64_t strided_offset(const Layout& l, int64_t e) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    off += (e % l.sizes[d]) * l.strides[d];
    e /= l.sizes[d];
  }
  return off;
}

template <bool kPack>
__device__ __forceinline__ void copy_unit(
    uint8_t* unit, const CopyOp& op, int64_t in_op, int n, const Layout* __restrict__ layouts) {
  const int64_t toff = op.tensor_offset + in_op;
  auto* tensor = reinterpret_cast<uint8_t*>(op.tensor_ptr);
  if (op.layout < 0) {
    if (kPack) {
      copy_small(unit, tensor + toff, n);
    } else {
      copy_small(tensor + toff, unit, n);
    }
    return;
  }
  const Layout& l = layouts[op.layout];
  const int es = op.elem_size;
  for (int j = 0; j < n; j += es) {
    uint8_t* elem = tensor + strided_offset(l, (toff + j) / es) * es;
    if (kPack) {
      copy_small(unit + j, elem, es);
    } else {
      copy_small(elem, unit + j, es);
    }
  }
}

template <bool kPack>
__global__ void __launch_bounds__(kThreads) copy_bucket_kernel(
    uint8_t* __restrict__ bucket,
    int64_t nbytes,
    const CopyOp* __restrict__ ops,
    int64_t num_ops,
    const Layout* __restrict__ layouts,
    int64_t skip_min) {
  __shared__ int64_t first;
  const int64_t begin = blockIdx.x * kChunk;  // one window per block
  const int64_t end = min(begin + kChunk, nbytes);
  if (threadIdx.x < 32) {
    const int64_t f = warp_partition_point(
        num_ops, [&](int64_t k) { return ops[k].bucket_offset + ops[k].nbytes <= begin; });
    if (threadIdx.x == 0) first = f;
  }
  __syncthreads();
  int64_t i = first;
  if (i >= num_ops) return;
  CopyOp op = ops[i];
  // A thread's units are found first (walking the sorted runs forward), then the
  // aligned whole words among them are all loaded before any is stored, so each
  // thread has kUnitsPerThread reads in flight; the other units (strided, narrow,
  // a run's short tail) are copied after, one at a time, in a loop of their own
  // that keeps the element-wise code out of the unrolled one.
  uint8_t* words[kUnitsPerThread];  // the tensor's side of each aligned word; nullptr: none
  unsigned others = 0;
#pragma unroll
  for (int k = 0; k < kUnitsPerThread; ++k) {
    words[k] = nullptr;
    const int64_t pos = begin + (threadIdx.x + k * kThreads) * kAlign;
    if (pos >= end || i >= num_ops) continue;
    while (op.bucket_offset + op.nbytes <= pos) {
      if (++i >= num_ops) break;
      op = ops[i];
    }
    if (i >= num_ops) continue;
    if (pos < op.bucket_offset) continue;  // alignment padding between runs
    if (op.layout < 0 && op.nbytes >= skip_min) continue;  // copied another way (launch_copy_bucket)
    const int64_t in_op = pos - op.bucket_offset;
    const int n = static_cast<int>(min(kAlign, op.nbytes - in_op));
    uint8_t* t = reinterpret_cast<uint8_t*>(op.tensor_ptr) + op.tensor_offset + in_op;
    if (op.layout < 0 && n == kAlign && (reinterpret_cast<uintptr_t>(t) & 15) == 0) {
      words[k] = t;
    } else {
      others |= 1u << k;
    }
  }
  uint4 v[kUnitsPerThread];
#pragma unroll
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const uint8_t* from = kPack ? words[k] : bucket + begin + (threadIdx.x + k * kThreads) * kAlign;
    v[k] = words[k] != nullptr ? *reinterpret_cast<const uint4*>(from) : uint4{};
  }
#pragma unroll
  for (int k = 0; k < kUnitsPerThread; ++k) {
    uint8_t* to = kPack ? bucket + begin + (threadIdx.x + k * kThreads) * kAlign : words[k];
    if (words[k] != nullptr) *reinterpret_cast<uint4*>(to) = v[k];
  }
  if (others == 0) return;
  i = first;
  op = ops[i];
#pragma unroll 1
  for (int k = 0; k < kUnitsPerThread; ++k) {
    if ((others >> k & 1u) == 0) continue;
    const int64_t pos = begin + (threadIdx.x + k * kThreads) * kAlign;
    while (op.bucket_offset + op.nbytes <= pos) op = ops[++i];
    const int64_t in_op = pos - op.bucket_offset;
    copy_unit<kPack>(bucket + pos, op, in_op, static_cast<int>(min(kAlign, op.nbytes - in_op)), layouts);
  }
}

}  // namespace

void launch_copy_bucket(
    uint8_t* bucket,
    int64_t nbytes,
    const CopyOp* ops,
    int64_t num_ops,
    const Layout* layouts,
    bool pack,
    cudaStream_t stream,
    int64_t skip_min) {
  const int64_t windows = (nbytes + kChunk - 1) / kChunk;
  TORCH_CHECK(windows > 0 && windows <= INT_MAX, "bucket of ", nbytes, " bytes needs ", windows, " blocks");
  if (pack) {
    copy_bucket_kernel<true><<<static_cast<unsigned>(windows), kThreads, 0, stream>>>(
        bucket, nbytes, ops, num_ops, layouts, skip_min);
  } else {
    copy_bucket_kernel<false><<<static_cast<unsigned>(windows), kThreads, 0, stream>>>(
        bucket, nbytes, ops, num_ops, layouts, skip_min);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace coalesced_bcast

// pack/unpack on the GPU: one launch per bucket, driven by the copy table.
// Each block owns a fixed 32 KiB window of the bucket and finds the first run
// that reaches into it by binary search; each thread then moves 16-byte units,
// walking the (sorted) runs forward. Small tensors therefore cost no launches
// of their own, and large runs are copied with full 16-byte words.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>

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
  const int64_t windows = (nbytes + kChunk - 1) / kChunk;
  // One window per block, unless the grid was capped (copy_blocks_cap): then blocks stride over them.
  for (int64_t w = blockIdx.x; w < windows; w += gridDim.x) {
    const int64_t begin = w * kChunk;
    const int64_t end = min(begin + kChunk, nbytes);
    __syncthreads();  // every thread is done with the last window's `first`
    if (threadIdx.x == 0) {
      int64_t lo = 0, hi = num_ops;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ops[mid].bucket_offset + ops[mid].nbytes <= begin) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      first = lo;
    }
    __syncthreads();
    int64_t i = first;
    if (i >= num_ops) continue;
    CopyOp op = ops[i];
    for (int64_t pos = begin + threadIdx.x * kAlign; pos < end; pos += kThreads * kAlign) {
      while (op.bucket_offset + op.nbytes <= pos) {
        if (++i >= num_ops) break;
        op = ops[i];
      }
      if (i >= num_ops) break;
      if (pos < op.bucket_offset) continue;  // alignment padding between runs
      if (op.layout < 0 && op.nbytes >= skip_min) continue;  // copied another way (launch_copy_bucket)
      const int64_t in_op = pos - op.bucket_offset;
      const int n = static_cast<int>(min(kAlign, op.nbytes - in_op));
      copy_unit<kPack>(bucket + pos, op, in_op, n, layouts);
    }
  }
}

}  // namespace

int64_t copy_blocks_cap() {
  const char* v = std::getenv("COALESCED_BCAST_COPY_BLOCKS");  // per launch: the bench switches it between calls
  const int64_t n = v == nullptr ? 0 : std::atoll(v);
  return n > 0 ? n : static_cast<int64_t>(INT_MAX);
}

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
  const int64_t blocks = std::min(windows, copy_blocks_cap());
  if (pack) {
    copy_bucket_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        bucket, nbytes, ops, num_ops, layouts, skip_min);
  } else {
    copy_bucket_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        bucket, nbytes, ops, num_ops, layouts, skip_min);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace coalesced_bcast

// The verify hash on the GPU: one launch hashes every tensor, one block per
// 64 KiB chunk of one tensor (a block finds its tensor by binary search in the
// table), one atomic add per block; a second single-block launch finishes the
// per-tensor hashes and the digest. Many small tensors cost two launches, a
// large state streams at memory speed with 16-byte loads.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>

#include "verify.h"

namespace coalesced_bcast {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint64_t block_sum(uint64_t v, uint64_t* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  uint64_t s = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) s += scratch[w];
  }
  return s;  // meaningful in thread 0 only
}

__global__ void __launch_bounds__(kThreads) hash_chunks_kernel(
    const vhash::Item* __restrict__ items,
    int64_t num_items,
    const Layout* __restrict__ layouts,
    unsigned long long* __restrict__ sums) {
  __shared__ int64_t item_index;
  __shared__ uint64_t scratch[kWarps];
  const int64_t block = blockIdx.x;
  if (threadIdx.x == 0) {
    // The last item whose chunks start at or before this block: items with no
    // bytes share their first_chunk with the next one and are skipped.
    int64_t lo = 0, hi = num_items;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (items[mid].first_chunk <= block) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    item_index = lo;
  }
  __syncthreads();
  const vhash::Item it = items[item_index];
  const int64_t begin = (block - it.first_chunk) * vhash::kChunkBytes;
  const int64_t end = min(begin + vhash::kChunkBytes, it.nbytes);
  const int64_t w_begin = begin / 8, w_end = (end + 7) / 8;
  uint64_t acc = 0;
  if (it.layout >= 0) {
    const Layout l = layouts[it.layout];
    for (int64_t i = w_begin + threadIdx.x; i < w_end; i += kThreads) acc += vhash::word_term(vhash::strided_word(it, l, i), i);
  } else if ((it.ptr & 15) == 0) {
    // Pairs of words with one 16-byte load; a pair that reaches the tensor's
    // last, partial word takes the careful path.
    const int64_t full = it.nbytes / 16;  // pairs entirely inside the tensor
    const auto* pairs = reinterpret_cast<const ulonglong2*>(it.ptr);
#pragma unroll 4
    for (int64_t i = w_begin + 2 * threadIdx.x; i < w_end; i += 2 * kThreads) {
      if (i / 2 < full) {
        const ulonglong2 v = pairs[i / 2];
        acc += vhash::word_term(v.x, i) + vhash::word_term(v.y, i + 1);
      } else {
        acc += vhash::word_term(vhash::contiguous_word(it, i), i);
        if (i + 1 < w_end) acc += vhash::word_term(vhash::contiguous_word(it, i + 1), i + 1);
      }
    }
  } else {
    for (int64_t i = w_begin + threadIdx.x; i < w_end; i += kThreads) acc += vhash::word_term(vhash::contiguous_word(it, i), i);
  }
  const uint64_t total = block_sum(acc, scratch);
  if (threadIdx.x == 0) atomicAdd(sums + item_index, static_cast<unsigned long long>(total));
}

__global__ void __launch_bounds__(kThreads) finish_kernel(
    const vhash::Item* __restrict__ items,
    int64_t num_items,
    const unsigned long long* __restrict__ sums,
    uint64_t* __restrict__ out) {
  __shared__ uint64_t scratch[kWarps];
  uint64_t acc = 0;
  for (int64_t t = threadIdx.x; t < num_items; t += kThreads) {
    const uint64_t h = vhash::finish_tensor(sums[t], items[t].nbytes);
    out[t] = h;
    acc += vhash::digest_term(h, t);
  }
  const uint64_t total = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[num_items] = vhash::finish_digest(total, num_items);
}

}  // namespace

void hash_items_cuda(
    const std::vector<vhash::Item>& items,
    const std::vector<Layout>& layouts,
    int64_t total_chunks,
    at::Tensor out) {
  const auto n = static_cast<int64_t>(items.size());
  const auto device = out.device();
  auto stream = at::cuda::getCurrentCUDAStream(device.index());
  TORCH_CHECK(out.numel() == 2 * n + 1 && out.is_contiguous(), "verify: bad output buffer");
  TORCH_CHECK(total_chunks <= INT_MAX, "verify: ", total_chunks, " chunks exceed one launch");
  auto* result = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  auto* sums = reinterpret_cast<unsigned long long*>(result + n + 1);
  C10_CUDA_CHECK(cudaMemsetAsync(sums, 0, n * sizeof(unsigned long long), stream));

  // The table goes up through pinned memory: the copy is queued on the
  // current stream, and the caching host allocator keeps the pinned block
  // until that copy has run.
  const int64_t items_bytes = n * static_cast<int64_t>(sizeof(vhash::Item));
  const int64_t table_bytes = items_bytes + static_cast<int64_t>(layouts.size() * sizeof(Layout));
  at::Tensor table;
  if (table_bytes > 0) {
    auto host = at::empty({table_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr<uint8_t>(), items.data(), items_bytes);
    if (!layouts.empty()) {
      std::memcpy(host.data_ptr<uint8_t>() + items_bytes, layouts.data(), layouts.size() * sizeof(Layout));
    }
    table = at::empty({table_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    table.copy_(host, /*non_blocking=*/true);
  }
  const auto* d_items = n > 0 ? reinterpret_cast<const vhash::Item*>(table.data_ptr<uint8_t>()) : nullptr;
  const auto* d_layouts =
      layouts.empty() ? nullptr : reinterpret_cast<const Layout*>(table.data_ptr<uint8_t>() + items_bytes);
  if (total_chunks > 0) {
    hash_chunks_kernel<<<static_cast<unsigned>(total_chunks), kThreads, 0, stream>>>(d_items, n, d_layouts, sums);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  finish_kernel<<<1, kThreads, 0, stream>>>(d_items, n, sums, result);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace coalesced_bcast

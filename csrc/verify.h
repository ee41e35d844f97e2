// verify: a 64-bit hash per tensor over its bytes in logical (row-major)
// order, and a digest of all of them, computed where the tensors live (a few
// launches on CUDA whatever the number of tensors, memory-bound for large
// ones). Ranks compare digests after a sync to prove they hold the source's
// bytes. The same arithmetic runs on the host and the device, so CPU and CUDA
// results are equal bit for bit.
//
// Hash of a tensor of n bytes: S = sum over its 8-byte words w_i (the last one
// zero-padded) of fmix64(w_i + (i + 1) * K), mod 2^64; then H = fmix64(S +
// fmix64(n ^ K2)). Each term is a bijection of its word, so changing any one
// word (one flipped bit, a NaN payload, -0.0 for 0.0) always changes S and H;
// a sum is order-free, so blocks and threads add their parts in any order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "copy_table.h"

#if defined(__CUDACC__)
#define CB_HD __host__ __device__ __forceinline__
#else
#define CB_HD inline
#endif

namespace coalesced_bcast {

struct Plan;

namespace vhash {

constexpr uint64_t kWordKey = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kSizeKey = 0xC2B2AE3D27D4EB4Full;
// One CUDA block (one host task) hashes at most this many bytes of one tensor.
constexpr int64_t kChunkBytes = 64 << 10;

// What the kernel needs to know of one tensor; uploaded as raw bytes.
struct Item {
  uint64_t ptr;         // first element
  int64_t nbytes;
  int64_t first_chunk;  // chunks of the items before this one
  int32_t layout;       // -1: contiguous bytes; else an index into the layouts
  int32_t elem_size;
};
static_assert(sizeof(Item) == 32, "Item is uploaded as raw bytes");

CB_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

CB_HD uint64_t word_term(uint64_t word, int64_t index) {
  return fmix64(word + static_cast<uint64_t>(index + 1) * kWordKey);
}

CB_HD uint64_t finish_tensor(uint64_t sum, int64_t nbytes) {
  return fmix64(sum + fmix64(static_cast<uint64_t>(nbytes) ^ kSizeKey));
}

// The digest is a sum too, position-keyed so that two tensors' hashes cannot
// swap unnoticed.
CB_HD uint64_t digest_term(uint64_t hash, int64_t index) {
  return fmix64(hash + static_cast<uint64_t>(index + 1) * kSizeKey);
}

CB_HD uint64_t finish_digest(uint64_t sum, int64_t count) {
  return fmix64(sum ^ fmix64(static_cast<uint64_t>(count) + kWordKey));
}

// n (1..8) bytes at p as a little-endian integer, at any alignment.
CB_HD uint64_t load_le(const uint8_t* p, int n) {
#if defined(__CUDA_ARCH__)
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (n == 8 && (a & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  if (n == 8 && (a & 3) == 0) {
    const auto* q = reinterpret_cast<const uint32_t*>(p);
    return static_cast<uint64_t>(q[0]) | (static_cast<uint64_t>(q[1]) << 32);
  }
  if (n == 4 && (a & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  if (n == 2 && (a & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  uint64_t v = 0;
  for (int b = 0; b < n; ++b) v |= static_cast<uint64_t>(p[b]) << (8 * b);
  return v;
#else
  uint64_t v = 0;
  std::memcpy(&v, p, static_cast<size_t>(n));  // x86 and aarch64 hosts are little-endian, as the GPU is
  return v;
#endif
}

CB_HD int64_t strided_offset(const Layout& l, int64_t e) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    off += (e % l.sizes[d]) * l.strides[d];
    e /= l.sizes[d];
  }
  return off;
}

// Word i of a contiguous tensor.
CB_HD uint64_t contiguous_word(const Item& it, int64_t i) {
  const int64_t left = it.nbytes - i * 8;
  return load_le(reinterpret_cast<const uint8_t*>(it.ptr) + i * 8, left < 8 ? static_cast<int>(left) : 8);
}

// Word i of a strided tensor's logical byte stream, gathered element by
// element (elements never straddle words: sizes are 1, 2, 4, 8 or 16).
CB_HD uint64_t strided_word(const Item& it, const Layout& l, int64_t i) {
  const auto* base = reinterpret_cast<const uint8_t*>(it.ptr);
  const int es = it.elem_size;
  const int64_t q = i * 8;
  if (es >= 8) {
    const int64_t e = q / es;
    return load_le(base + strided_offset(l, e) * es + (q - e * es), 8);
  }
  uint64_t w = 0;
  const int64_t e0 = q / es;
  for (int k = 0; k < 8 / es; ++k) {
    const int64_t e = e0 + k;
    if ((e + 1) * es > it.nbytes) break;
    w |= load_le(base + strided_offset(l, e) * es, es) << (8 * es * k);
  }
  return w;
}

}  // namespace vhash

// Per tensor its hash, then the digest of them all: an int64 tensor of
// tensors.size() + 1 entries on the tensors' device. All tensors must be
// dense and on one device (cpu or cuda). On CUDA the work is queued on the
// current stream; nothing is synchronized.
at::Tensor hash_tensors(const std::vector<at::Tensor>& tensors);

#ifdef WITH_CUDA
// Fills out (n + 1 entries, then n of scratch) from a table already built on
// the host (verify_cuda.cu).
void hash_items_cuda(
    const std::vector<vhash::Item>& items,
    const std::vector<Layout>& layouts,
    int64_t total_chunks,
    at::Tensor out);
#endif

// Test hook: a copy of the plan with one field of its copy table corrupted
// ("what"), run through validate_copy_table; returns its error message, or ""
// if the corruption went unnoticed.
std::string check_corrupted_table(const Plan& plan, const std::string& what);

}  // namespace coalesced_bcast

// direct buckets: a bucket whose bytes already lie, in order and back to back,
// in one storage of this rank needs no copy on this rank. Its broadcast reads
// (a refit's sender) or writes (a receiver) them where they are, and the ring
// slot is skipped. Decided by each rank alone: a broadcast only needs every
// rank's buffer to hold the bucket's bytes, wherever that buffer is. An
// unsharded trainer's state and an engine's parameters laid out in one buffer
// then move with no copy at all, as one flat broadcast in bucket-sized pieces.
#include <algorithm>

#include "plan.h"

namespace coalesced_bcast {

bool mark_direct(Plan& plan, int64_t k, std::vector<SpanRun>& runs,
                 const std::vector<const c10::StorageImpl*>& excluded) {
  auto& bucket = plan.buckets.at(k);
  const int64_t nbytes = bucket.nbytes;
  if (runs.empty() || nbytes <= 0) return false;
  std::sort(runs.begin(), runs.end(),
            [](const SpanRun& a, const SpanRun& b) { return a.bucket_offset < b.bucket_offset; });
  const auto& first = runs.front();
  if (first.bucket_offset != 0 || first.storage == nullptr ||
      std::binary_search(excluded.begin(), excluded.end(), first.storage)) {
    return false;
  }
  const uint64_t base = first.address;  // the bucket's byte 0 in this rank's memory
  // Whole aligned 16-byte words only, as for sync's in-place tensors (plan.cpp): NCCL's LL protocol
  // reads up to a word past a buffer's end, harmless in a ring slot but not at a tensor's.
  if (nbytes % kAlign != 0 || base % kAlign != 0) return false;
  int64_t end = 0;
  for (const auto& r : runs) {
    if (!r.plain || r.storage != first.storage || r.bucket_offset != end ||
        r.address != base + static_cast<uint64_t>(r.bucket_offset)) {
      return false;
    }
    end += r.nbytes;
  }
  if (end != nbytes) return false;
  bucket.direct_tensor = first.tensor;
  bucket.direct_offset = static_cast<int64_t>(base - reinterpret_cast<uint64_t>(first.storage->data()));
  ++plan.direct_buckets;
  return true;
}

at::Tensor direct_bytes(const Plan& plan, int64_t k) {
  const auto& b = plan.buckets.at(k);
  const auto& t = (plan.direct_from_inputs ? plan.inputs : plan.dests).at(b.direct_tensor);
  // A view of the tensor's own storage (not from_blob): what the caching allocator and c10d know.
  return at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), b.direct_offset, {b.nbytes}, {1});
}

}  // namespace coalesced_bcast

// pack/unpack on the host: the same copy table the CUDA kernel reads, walked
// with memcpy for contiguous runs and an odometer for strided ones.
#include <cstring>

#include "executor.h"

namespace coalesced_bcast {
namespace {

void copy_strided(const CopyOp& op, const Layout& l, uint8_t* bucket_run, bool pack) {
  const int64_t es = op.elem_size;
  int64_t coord[kMaxDims];
  int64_t e = op.tensor_offset / es;  // first element, in logical order
  for (int d = l.ndim - 1; d >= 0; --d) {
    coord[d] = e % l.sizes[d];
    e /= l.sizes[d];
  }
  auto* base = reinterpret_cast<uint8_t*>(op.tensor_ptr);
  const int64_t n = op.nbytes / es;
  for (int64_t j = 0; j < n; ++j) {
    int64_t off = 0;
    for (int d = 0; d < l.ndim; ++d) off += coord[d] * l.strides[d];
    uint8_t* elem = base + off * es;
    if (pack) {
      std::memcpy(bucket_run + j * es, elem, es);
    } else {
      std::memcpy(elem, bucket_run + j * es, es);
    }
    for (int d = l.ndim - 1; d >= 0; --d) {
      if (++coord[d] < l.sizes[d]) break;
      coord[d] = 0;
    }
  }
}

}  // namespace

void copy_bucket_cpu(const Plan& plan, int64_t bucket, uint8_t* slot, bool pack) {
  const auto& b = plan.buckets[bucket];
  for (int64_t i = b.first_op; i < b.first_op + b.num_ops; ++i) {
    const auto& op = plan.ops[i];
    uint8_t* run = slot + op.bucket_offset;
    if (op.layout >= 0) {
      copy_strided(op, plan.layouts[op.layout], run, pack);
      continue;
    }
    auto* t = reinterpret_cast<uint8_t*>(op.tensor_ptr) + op.tensor_offset;
    if (pack) {
      std::memcpy(run, t, op.nbytes);
    } else {
      std::memcpy(t, run, op.nbytes);
    }
  }
}

}  // namespace coalesced_bcast

// pack/unpack on the host: the same copy table the CUDA kernel reads, walked
// with memcpy for contiguous runs and an odometer for strided ones; a load's
// cast-copy runs (a load's scatter, a refit's pack) element by element where
// they write a shard's box.
#include <ATen/ATen.h>

#include <cstring>

#include "cast.h"
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

void copy_runs_cpu(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* slot, bool pack) {
  for (int64_t i = 0; i < count; ++i) {
    const auto& op = ops[i];
    uint8_t* run = slot + op.bucket_offset;
    if (op.layout >= 0) {
      copy_strided(op, layouts[op.layout], run, pack);
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

void copy_bucket_cpu(const Plan& plan, int64_t bucket, uint8_t* slot, bool pack) {
  const auto& b = plan.buckets[bucket];
  copy_runs_cpu(plan.ops.data() + b.first_op, b.num_ops, plan.layouts, slot, pack);
}

void copy_cast_runs_cpu(const ScatterOp* ops, int64_t count, const std::vector<Box>& boxes, uintptr_t src_base,
                        uintptr_t dst_base) {
  at::Tensor converted;
  for (int64_t i = 0; i < count; ++i) {
    const auto& op = ops[i];
    const auto* src = reinterpret_cast<const uint8_t*>(src_base + op.bucket_offset);
    auto* dst = reinterpret_cast<uint8_t*>(dst_base + op.dst_ptr);
    const int64_t ds = op.dst_size;
    if (op.src_type != op.dst_type) {
      // Casts go through torch's own CPU copy, so that they give what load_state_dict's copy_ gives
      // bit for bit (its vectorized float->bfloat16 maps every NaN to 0xFFFF; c10's scalar
      // conversion, which the CUDA kernel shares with torch's CUDA copy, to 0x7FC0).
      // A 0-dim destination as a 0-dim tensor (kScalar in copy_table.h), as load_state_dict copies it.
      const int64_t n = op.count;
      const auto shape = op.box == kScalar ? c10::IntArrayRef() : c10::IntArrayRef(n);
      const auto from = at::from_blob(const_cast<uint8_t*>(src), shape,
                                      at::TensorOptions().dtype(static_cast<c10::ScalarType>(op.src_type)));
      converted = at::empty(shape, at::TensorOptions().dtype(static_cast<c10::ScalarType>(op.dst_type)));
      converted.copy_(from);
      src = static_cast<const uint8_t*>(converted.data_ptr());
    }
    if (op.box < 0) {
      std::memcpy(dst + op.first * ds, src, op.count * ds);
      continue;
    }
    for (int64_t j = 0; j < op.count; ++j) {
      int64_t off = 0;
      if (box_offset(boxes[op.box], op.first + j, &off)) std::memcpy(dst + off * ds, src + j * ds, ds);
    }
  }
}

}  // namespace coalesced_bcast

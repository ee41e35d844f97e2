// What a load's unpack does to one element, shared by the host and the CUDA
// kernel so both write the same bits: a copy, or a cast between floating
// dtypes. A cast is c10::convert, what torch's own copy_ does: NaN payloads
// and rounding included, and a float into uint8 through int64 (negative
// values wrap, where a plain static_cast would saturate them on the GPU).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>

#include <cstdint>
#include <cstring>

#include "copy_table.h"

namespace coalesced_bcast {

// The dtypes a load may cast between (real numbers and bool); complex and
// float8 checkpoints must match the model's dtype exactly.
inline bool castable(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf:
    case c10::kBFloat16:
    case c10::kFloat:
    case c10::kDouble:
    case c10::kByte:
    case c10::kChar:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
    case c10::kBool:
      return true;
    default:
      return false;
  }
}

#define CB_CASTABLE_TYPES(_) \
  _(c10::kHalf, c10::Half)   \
  _(c10::kBFloat16, c10::BFloat16) \
  _(c10::kFloat, float)      \
  _(c10::kDouble, double)    \
  _(c10::kByte, uint8_t)     \
  _(c10::kChar, int8_t)      \
  _(c10::kShort, int16_t)    \
  _(c10::kInt, int32_t)      \
  _(c10::kLong, int64_t)     \
  _(c10::kBool, bool)

template <typename Src>
C10_HOST_DEVICE inline void store_as(const Src v, void* dst, int8_t dst_type) {
#define CB_STORE(code, T)                            \
  case code:                                         \
    *static_cast<T*>(dst) = c10::convert<T>(v);       \
    break;
  switch (static_cast<c10::ScalarType>(dst_type)) { CB_CASTABLE_TYPES(CB_STORE) default : break; }
#undef CB_STORE
}

// One element from `src` (of src_type) to `dst` (of dst_type); both castable.
C10_HOST_DEVICE inline void cast_element(const void* src, int8_t src_type, void* dst, int8_t dst_type) {
#define CB_LOAD(code, T)                                       \
  case code:                                                   \
    store_as(*static_cast<const T*>(src), dst, dst_type);      \
    break;
  switch (static_cast<c10::ScalarType>(src_type)) { CB_CASTABLE_TYPES(CB_LOAD) default : break; }
#undef CB_LOAD
}

// Where element `e` of the full tensor lands in the destination (an element
// offset), or false when the destination does not hold it.
C10_HOST_DEVICE inline bool box_offset(const Box& b, int64_t e, int64_t* offset) {
  int64_t off = 0;
  for (int d = b.ndim - 1; d >= 0; --d) {
    const int64_t c = e % b.sizes[d];
    e /= b.sizes[d];
    if (c < b.lo[d] || c >= b.hi[d]) return false;
    off += (c - b.lo[d]) * b.strides[d];
  }
  *offset = off;
  return true;
}

}  // namespace coalesced_bcast

// units: the byte stream that loads and refits lay out from a table of tensors
// (dtype, ndim, sizes) alone, identically on every rank: each tensor ("unit")
// on a 16-byte boundary, back to back, cut into buckets of bucket_bytes.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "copy_table.h"

namespace coalesced_bcast {

struct Unit {
  c10::ScalarType dtype;
  int64_t ndim;
  int64_t sizes[kMaxDims];
  int64_t numel;
  int64_t elem_size;
  int64_t offset;  // in the byte stream
  int64_t nbytes;
};

// "[4, 8]"
std::string sizes_str(const Unit& u);

// The unit of one table row (dtype, ndim, sizes), its offset left 0.
Unit read_unit(const int64_t* row);

// Where a unit of `nbytes` starts in the stream, the one before it ending at `end` (whole_in: as read_units).
int64_t unit_offset(int64_t end, int64_t nbytes, int64_t whole_in = 0);

// The units of an int64 [n, 2 + kMaxDims] table, with their stream offsets.
// whole_in (a refit's bucket bytes; 0: none): a unit of at most that many
// bytes that would cross a multiple of it starts at that multiple instead, so
// that every unit that fits in a bucket arrives whole in one (a receiver's
// callback gets it as one view).
std::vector<Unit> read_units(const at::Tensor& units, int64_t whole_in = 0);

// Per bucket of `bucket_bytes`, the bytes up to the end of its last unit: a
// bucket whose tail is padding (whole_in) is sent without it.
std::vector<int64_t> bucket_sizes(const std::vector<Unit>& units, int64_t bucket_bytes);

// Bytes of the stream (the last unit's end).
inline int64_t stream_bytes(const std::vector<Unit>& units) {
  return units.empty() ? 0 : units.back().offset + units.back().nbytes;
}

}  // namespace coalesced_bcast

#include "units.h"

#include <algorithm>
#include <sstream>

#include "plan.h"

namespace coalesced_bcast {

std::string sizes_str(const Unit& u) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < u.ndim; ++d) s << (d ? ", " : "") << u.sizes[d];
  s << "]";
  return s.str();
}

Unit read_unit(const int64_t* p) {
  Unit x;
  x.dtype = static_cast<c10::ScalarType>(p[0]);
  x.ndim = p[1];
  TORCH_CHECK_VALUE(x.ndim >= 0 && x.ndim <= kMaxDims, "a checkpoint tensor has ", x.ndim, " dims; at most ",
                    kMaxDims, " are supported");
  x.numel = 1;
  for (int64_t d = 0; d < kMaxDims; ++d) {
    x.sizes[d] = d < x.ndim ? p[2 + d] : 1;
    x.numel *= x.sizes[d];
  }
  x.elem_size = static_cast<int64_t>(c10::elementSize(x.dtype));
  x.nbytes = x.numel * x.elem_size;
  x.offset = 0;
  return x;
}

int64_t unit_offset(int64_t end, int64_t nbytes, int64_t whole_in) {
  // Every tensor starts on a 16-byte boundary: packed runs are whole words.
  int64_t offset = nbytes > 0 ? align_up(end, kAlign) : end;
  // An empty unit crosses nothing: moving one that sits on a multiple would open a bucket of 0 bytes.
  if (whole_in > 0 && nbytes > 0 && nbytes <= whole_in && offset / whole_in != (offset + nbytes - 1) / whole_in) {
    offset = (offset / whole_in + 1) * whole_in;
  }
  return offset;
}

std::vector<Unit> read_units(const at::Tensor& units, int64_t whole_in) {
  TORCH_CHECK_VALUE(
      units.scalar_type() == at::kLong && units.is_cpu() && units.dim() == 2 && units.size(1) == 2 + kMaxDims,
      "units must be a cpu int64 tensor of shape [n, ", 2 + kMaxDims, "], got ", units.toString());
  const auto u = units.contiguous();
  const auto* p = u.data_ptr<int64_t>();
  std::vector<Unit> out;
  out.reserve(u.size(0));
  int64_t offset = 0;
  for (int64_t i = 0; i < u.size(0); ++i, p += 2 + kMaxDims) {
    auto& x = out.emplace_back(read_unit(p));
    x.offset = unit_offset(offset, x.nbytes, whole_in);
    offset = x.offset + x.nbytes;
  }
  return out;
}

std::vector<int64_t> bucket_sizes(const std::vector<Unit>& units, int64_t B) {
  std::vector<int64_t> sizes(static_cast<size_t>((stream_bytes(units) + B - 1) / B), 0);
  for (const auto& u : units) {
    if (u.nbytes == 0) continue;
    const int64_t end = u.offset + u.nbytes;
    for (int64_t k = u.offset / B; k <= (end - 1) / B; ++k) sizes[k] = std::max(sizes[k], std::min(end, (k + 1) * B) - k * B);
  }
  return sizes;
}

at::Tensor bucket_units(const at::Tensor& units_table, int64_t bucket_bytes, bool whole) {
  TORCH_CHECK_VALUE(bucket_bytes > 0 && bucket_bytes % kAlign == 0, "bucket_bytes must be a positive multiple of ",
                    kAlign, ", got ", bucket_bytes);
  const auto units = read_units(units_table, whole ? bucket_bytes : 0);
  std::vector<int64_t> rows;
  const int64_t B = bucket_bytes;
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    for (int64_t e = 0; e < u.numel && u.nbytes > 0;) {
      const int64_t pos = u.offset + e * u.elem_size;
      const int64_t k = pos / B;
      const int64_t end = std::min(u.numel, ((k + 1) * B - u.offset) / u.elem_size);
      rows.insert(rows.end(), {k, static_cast<int64_t>(i), e, end - e, pos - k * B});
      e = end;
    }
  }
  // Units are laid out in order, so rows are already sorted by bucket.
  return at::tensor(rows, at::kLong).view({-1, 5});
}

}  // namespace coalesced_bcast

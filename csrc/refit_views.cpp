#include "refit_views.h"

namespace coalesced_bcast {

SlotViews::SlotViews(const at::Tensor& units, const at::Tensor& rows, std::vector<py::object> names)
    : units_(read_units(units)) {
  // Offsets come from the rows: the stream's layout (whole_in or not) does not matter here.
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(1) == 5 && rows.is_cpu(),
                    "rows must be bucket_units' int64 [n, 5] rows, got ", rows.toString());
  TORCH_CHECK_VALUE(names.empty() || names.size() == units_.size(), "got ", names.size(), " names for ",
                    units_.size(), " units");
  const auto r = rows.contiguous();
  rows_.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  const int64_t m = r.size(0);
  starts_.push_back(0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t* p = rows_.data() + i * 5;
    TORCH_CHECK_VALUE(p[1] >= 0 && p[1] < static_cast<int64_t>(units_.size()), "row ", i, " names unit ", p[1]);
    TORCH_CHECK_VALUE(p[0] >= num_buckets(), "rows are not sorted by bucket at row ", i);
    while (num_buckets() < p[0]) starts_.push_back(i);  // a bucket without rows gets an empty range
  }
  if (m > 0) starts_.push_back(m);
  for (size_t u = 0; u < names.size(); ++u) {
    TORCH_CHECK_TYPE(names[u].is_none() || py::isinstance<py::str>(names[u]), "the name of unit ", u,
                     " is a ", py::str(py::type::of(names[u])).cast<std::string>(), ", not a str or None");
    names_.push_back(std::move(names[u]));
    py::tuple shape(units_[u].ndim);
    for (int64_t d = 0; d < units_[u].ndim; ++d) shape[d] = py::int_(units_[u].sizes[d]);
    shapes_.push_back(std::move(shape));
  }
}

at::Tensor SlotViews::view(const int64_t* p, const at::Tensor& slot) const {
  const auto& u = units_[p[1]];
  TORCH_CHECK_VALUE(p[4] >= 0 && p[4] + p[3] * u.elem_size <= slot.numel(), "a row of unit ", p[1],
                    " is outside the slot of ", slot.numel(), " bytes");
  auto v = slot.narrow(0, p[4], p[3] * u.elem_size).view(u.dtype);
  return p[2] == 0 && p[3] == u.numel ? v.view(at::IntArrayRef(u.sizes, u.ndim)) : v;
}

std::vector<at::Tensor> SlotViews::views(int64_t k, const at::Tensor& slot) const {
  TORCH_CHECK_VALUE(k >= 0 && k < num_buckets(), "bucket ", k, " of ", num_buckets());
  std::vector<at::Tensor> out;
  out.reserve(starts_[k + 1] - starts_[k]);
  for (int64_t i = starts_[k]; i < starts_[k + 1]; ++i) out.push_back(view(rows_.data() + i * 5, slot));
  return out;
}

py::tuple SlotViews::batch(int64_t k, const at::Tensor& slot) const {
  TORCH_CHECK_VALUE(k >= 0 && k < num_buckets(), "bucket ", k, " of ", num_buckets());
  TORCH_CHECK_VALUE(!names_.empty(), "SlotViews made without names has no batches");
  py::list pairs, pieces;
  for (int64_t i = starts_[k]; i < starts_[k + 1]; ++i) {
    const int64_t* p = rows_.data() + i * 5;
    if (names_[p[1]].is_none()) continue;  // mapped to no name: this side does not take it
    const auto& u = units_[p[1]];
    py::object v = py::cast(view(p, slot));
    if (p[2] == 0 && p[3] == u.numel) {
      pairs.append(py::make_tuple(names_[p[1]], v));
    } else {
      pieces.append(py::make_tuple(names_[p[1]], v, p[2], shapes_[p[1]]));
    }
  }
  return py::make_tuple(pairs, pieces);
}

}  // namespace coalesced_bcast

// A refit receiver's (and a verifying sender's) view of each bucket: per
// bucket_units row, a view into the ring slot, shaped when the row is a whole
// unit; with names, the (name, view) pairs and (name, flat view, first
// element, full shape) pieces an engine's callback takes. Units and rows are
// read once per plan, not once per bucket: reading the whole units table per
// bucket costs a refit of many buckets a pass over every unit for each one.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "units.h"

namespace coalesced_bcast {

namespace py = pybind11;

class SlotViews {
 public:
  // units: int64 [n, 2 + kMaxDims]; rows: bucket_units' int64 [m, 5] (sorted by bucket);
  // names: one per unit, a str or None (the unit is left out of the batches), or none at all when
  // only views() is used.
  SlotViews(const at::Tensor& units, const at::Tensor& rows, std::vector<py::object> names);

  int64_t num_buckets() const {
    return static_cast<int64_t>(starts_.size()) - 1;
  }
  // The views of bucket k's rows into `slot` (a flat uint8 tensor of at least the bucket's bytes).
  std::vector<at::Tensor> views(int64_t k, const at::Tensor& slot) const;
  // (pairs, pieces) for a callback: pairs of whole units, pieces of units split over buckets.
  py::tuple batch(int64_t k, const at::Tensor& slot) const;

 private:
  at::Tensor view(const int64_t* row, const at::Tensor& slot) const;

  std::vector<Unit> units_;
  std::vector<int64_t> rows_;    // m x 5
  std::vector<int64_t> starts_;  // per bucket, its first row; then m
  std::vector<py::object> names_;   // per unit, its Python str (None: not in the batches)
  std::vector<py::object> shapes_;  // per unit, its full shape as a tuple
};

}  // namespace coalesced_bcast

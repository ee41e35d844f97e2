// bind: the pieces of the Python module (csrc/bindings.cpp registers them),
// one bind_* function per area, and the conversions they share.
#pragma once

#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <vector>

#include "pipeline.h"
#include "plan.h"
#include "tensor_refs.h"

namespace coalesced_bcast {

namespace py = pybind11;

// Values, codes and test hooks of general use; TensorList, IdSet; the attribute names' hand-over.
void bind_util(py::module_& m);
// Side streams and host waits.
void bind_streams(py::module_& m);
// Fingerprints and hashes (verify).
void bind_verify(py::module_& m);
// Plan (a sync's plan and what runs it), its prepared run and host reads, module walks for a sync.
// Returns Plan's class, for the areas that add methods to it.
py::class_<Plan> bind_sync(py::module_& m);
// A load: its plans (made on threads), its model and source sides, the host stage's test hooks.
void bind_load(py::module_& m);
// A refit: its plans, slot views and test hooks; Plan.refit_send.
void bind_refit(py::module_& m, py::class_<Plan>& plan);

// The tensors of a list or tuple (or any sequence pybind converts); `what` names an item in errors.
std::vector<at::Tensor> tensors_from(const py::handle& seq, const char* what);
// The same, borrowed: the result holds a tuple of the items, which owns every impl (tensor_refs.h).
TensorRefs borrowed_tensors_from(const py::handle& seq, const char* what);
// A list of tensors, or a TensorList's tensors, taken out of it (it is single-use).
std::vector<at::Tensor> tensors_of(const py::handle& h);

LoadOptions load_options(int64_t bucket_bytes, int64_t ring_depth, int64_t rank, c10::Device device,
                         bool whole_units);
// seconds > 0 as a deadline, else c10d's unset timeout (the group's own).
std::chrono::milliseconds to_timeout(double seconds);
// A Python callable as a BucketHook: called with the GIL, from inside the transfer.
BucketHook as_hook(const std::optional<py::function>& fn);

}  // namespace coalesced_bcast

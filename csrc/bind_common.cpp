// The conversions the bind_* files share (bind.h).
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <memory>

#include "bind.h"
#include "chunks.h"
#include "tensor_list.h"

namespace coalesced_bcast {
namespace {

// The tensors of a Python list or tuple's items, in one pass that prefetches
// ahead: each item's PyObject, then (where `touch_impl`: taking a reference
// writes there) the TensorImpl it holds. pybind's own conversion touches one
// cold object after the other and waits on memory at each (a model's tensors
// were made between other allocations).
template <typename Take>
void for_tensor_items(PyObject** items, Py_ssize_t n, const char* what, bool touch_impl, Take take) {
  constexpr Py_ssize_t kAhead = 16;
  for (Py_ssize_t i = 0; i < std::min(n, 2 * kAhead); ++i) prefetch_object(items[i]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) prefetch_object(items[i + 2 * kAhead]);
    if (touch_impl && i + kAhead < n && THPVariable_Check(items[i + kAhead])) {
      prefetch_impl(THPVariable_Unpack(items[i + kAhead]).unsafeGetTensorImpl());
    }
    PyObject* t = items[i];
    TORCH_CHECK_TYPE(THPVariable_Check(t), what, " ", i, " is a ", Py_TYPE(t)->tp_name, ", not a torch.Tensor");
    take(THPVariable_Unpack(t));
  }
}

}  // namespace

std::vector<at::Tensor> tensors_from(const py::handle& seq, const char* what) {
  PyObject* o = seq.ptr();
  if (!PyList_Check(o) && !PyTuple_Check(o)) return seq.cast<std::vector<at::Tensor>>();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  std::vector<at::Tensor> out;
  out.reserve(n);
  for_tensor_items(PySequence_Fast_ITEMS(o), n, what, true, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

// The plan keeps a tuple of the items (a snapshot: the caller may change its list), which owns every impl.
TensorRefs borrowed_tensors_from(const py::handle& seq, const char* what) {
  PyObject* o = seq.ptr();
  if (!PyList_Check(o) && !PyTuple_Check(o)) return TensorRefs(seq.cast<std::vector<at::Tensor>>());
  PyObject* items_tuple = PySequence_Tuple(o);
  if (items_tuple == nullptr) throw py::error_already_set();
  TensorRefs out;
  out.borrow_from(std::shared_ptr<void>(items_tuple, [](void* p) {
    if (!Py_IsInitialized()) return;  // at exit: the interpreter has let go of everything
    py::gil_scoped_acquire gil;
    Py_DECREF(static_cast<PyObject*>(p));
  }));
  const Py_ssize_t n = PyTuple_GET_SIZE(items_tuple);
  out.reserve(n);
  for_tensor_items(&PyTuple_GET_ITEM(items_tuple, 0), n, what, false,
                   [&](const at::Tensor& t) { out.borrow(t.unsafeGetTensorImpl()); });
  return out;
}

std::vector<at::Tensor> tensors_of(const py::handle& h) {
  if (py::isinstance<TensorList>(h)) return std::move(h.cast<TensorList&>().tensors);
  return tensors_from(h, "item");
}

LoadOptions load_options(int64_t bucket_bytes, int64_t ring_depth, int64_t rank, c10::Device device,
                         bool whole_units) {
  LoadOptions o;
  o.bucket_bytes = bucket_bytes;
  o.ring_depth = ring_depth;
  o.rank = rank;
  o.device = device;
  o.whole_units = whole_units;
  return o;
}

std::chrono::milliseconds to_timeout(double seconds) {
  return seconds > 0 ? std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)) : c10d::kUnsetTimeout;
}

BucketHook as_hook(const std::optional<py::function>& fn) {
  if (!fn) return {};
  return [fn](int64_t bucket, const at::Tensor& slot) {
    py::gil_scoped_acquire gil;
    (*fn)(bucket, slot);
  };
}

}  // namespace coalesced_bcast

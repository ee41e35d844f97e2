// The module's values and codes, its TensorList and IdSet, the attribute
// names' hand-over, and its streams and host waits.
#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "bind.h"
#include "executor.h"
#include "host_wait.h"
#include "id_table.h"
#include "module_attrs.h"
#include "tensor_list.h"
#include "test_hooks.h"

namespace coalesced_bcast {

void bind_util(py::module_& m) {
  m.attr("with_cuda") = py::bool_(
#ifdef WITH_CUDA
      true
#else
      false
#endif
  );
  m.def("dtype_name", [](int64_t code) { return std::string(c10::toString(static_cast<c10::ScalarType>(code))); });
  {
    const PlanOptions d;
    py::dict defaults;
    defaults["bucket_bytes"] = d.bucket_bytes;
    defaults["ring_depth"] = d.ring_depth;
    defaults["inplace_min_bytes"] = d.inplace_min_bytes;
    defaults["coalesce_bytes"] = d.coalesce_bytes;
    defaults["small_inplace_max"] = d.small_inplace_max;
    m.attr("defaults") = defaults;
  }
  m.def("scalar_type_code", [](at::ScalarType t) { return static_cast<int64_t>(t); });
  m.def("scalar_type_size", [](int64_t code) { return c10::elementSize(static_cast<c10::ScalarType>(code)); });
  m.def("_test_refuse_next_host_batch", &test_refuse_next_host_batch, py::arg("refuse"),
        "Test hook: the next batched host read passes arguments the CUDA runtime refuses (csrc/test_hooks.h)");
  m.def("set_attribute_names", &set_torch_names, py::arg("names"),
        "The names of torch's private attributes the extension reads, by role "
        "(coalesced_bcast._torch_internals.CPP_NAMES)");
  py::class_<TensorList>(m, "TensorList", "Tensors held in C++ between two calls (csrc/tensor_list.h)")
      .def("__len__", [](const TensorList& l) { return l.tensors.size(); })
      .def(
          "take",
          [](const TensorList& l, const at::Tensor& rows) {
            TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be int64 [n], got ",
                              rows.toString());
            const auto r = rows.contiguous();
            const auto n = static_cast<int64_t>(l.tensors.size());
            TensorList out;
            out.tensors.reserve(r.numel());
            for (int64_t i = 0; i < r.numel(); ++i) {
              const int64_t j = r.data_ptr<int64_t>()[i];
              TORCH_CHECK_INDEX(j >= 0 && j < n, "row ", j, " of a list of ", n, " tensors");
              out.tensors.push_back(l.tensors[j]);
            }
            return out;
          },
          py::arg("rows"), "A new list of the tensors at rows, in that order");
  py::class_<IdSet>(m, "IdSet", "ids of objects (csrc/id_table.h): a load's parameters and buffers")
      .def(py::init([](const py::iterable& ids) {
             IdSet s;
             for (const auto& id : ids) s.add(id.cast<uintptr_t>());
             return s;
           }),
           py::arg("ids"))
      .def("__contains__", [](const IdSet& s, const py::object& id) {
        return py::isinstance<py::int_>(id) && s.contains(id.cast<uintptr_t>());
      })
      .def("__len__", &IdSet::size)
      .def("__eq__", [](const IdSet& a, const IdSet& b) {
        bool same = a.size() == b.size();
        a.for_each([&](uintptr_t id) { same = same && b.contains(id); });
        return same;
      })
      .def("to_set", [](const IdSet& s) {
        py::set out;
        s.for_each([&](uintptr_t id) { out.add(py::int_(id)); });
        return out;
      });
}

void bind_streams(py::module_& m) {
#ifdef WITH_CUDA
  m.def(
      "_lane_stream",
      [](int64_t device, const std::string& lane) {
        // Test hook: (stream_id, device_index, device_type) of a lane's stream, for torch.cuda.Stream(...),
        // so that a test can hold a lane busy and check that the others wait where they must.
        TORCH_CHECK_VALUE(lane == "comm" || lane == "copy" || lane == "send", "_lane_stream: a lane of comm, copy, "
                          "send, got '", lane, "'");
        const auto s = cuda_lane_stream(static_cast<c10::DeviceIndex>(device),
                                        lane == "comm" ? Lane::kComm : lane == "copy" ? Lane::kCopy : Lane::kSend);
        return std::make_tuple(s.id(), static_cast<int64_t>(s.device_index()), static_cast<int64_t>(s.device_type()));
      },
      py::arg("device"), py::arg("lane"));
#endif
  m.def("wait_stream", &wait_stream, py::arg("device"), py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
        "Wait on the host for the work queued on the device's current stream; False once `seconds` passed");
  m.def(
      "poll_until",
      [](const py::function& done, double seconds) { return poll_until([&] { return done().cast<bool>(); }, seconds); },
      py::arg("done"), py::arg("seconds"), "wait_stream's loop over a Python predicate (for tests)");
  py::class_<ControlStream>(m, "ControlStream", "A per-device side stream made current for a with-block")
      .def(py::init<c10::Device>(), py::arg("device"))
      .def("__enter__", [](ControlStream& s) { s.enter(); })
      .def("__exit__", [](ControlStream& s, const py::args&) {
        s.exit();
        return false;
      });
}

}  // namespace coalesced_bcast

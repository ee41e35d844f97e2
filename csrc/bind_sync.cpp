// A sync's Plan and what runs it: its prepared run, the host reads a broadcast
// leaves, the copy test hook, and the module walks a sync reads its tensors by.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bind.h"
#include "executor.h"
#include "module_walk.h"
#include "pipeline.h"
#include "plan.h"

namespace coalesced_bcast {
namespace {

Plan build_plan(
    const py::handle& tensors,
    const std::vector<std::string>& names,
    int64_t bucket_bytes,
    int64_t ring_depth,
    int64_t inplace_min_bytes,
    int64_t coalesce_bytes,
    int64_t rank,
    int64_t small_inplace_max) {
  PlanOptions o;
  o.bucket_bytes = bucket_bytes;
  o.ring_depth = ring_depth;
  o.inplace_min_bytes = inplace_min_bytes;
  o.coalesce_bytes = coalesce_bytes;
  o.rank = rank;
  o.small_inplace_max = small_inplace_max;
  return make_plan(borrowed_tensors_from(tensors, "tensor"), names, o);
}

// Per bucket: (unique index, tensor offset, bucket offset, bytes, strided).
py::list bucket_table(const Plan& plan) {
  py::list out;
  for (const auto& b : plan.buckets) {
    py::list ops;
    for (int64_t i = b.first_op; i < b.first_op + b.num_ops; ++i) {
      const auto& op = plan.ops[i];
      ops.append(py::make_tuple(plan.op_unique[i], op.tensor_offset, op.bucket_offset, op.nbytes, op.layout >= 0));
    }
    out.append(py::make_tuple(b.nbytes, ops));
  }
  return out;
}


// The first i whose owners[i][keys[i]] is no longer tensors[i] (a module's parameter or buffer
// assigned anew since a kept plan was made), or -1: a kept module plan's check on every run.
int64_t first_replaced(const py::list& owners, const py::list& keys, const py::list& tensors) {
  const auto n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(owners.size()) == n && static_cast<int64_t>(keys.size()) == n,
                    "first_replaced takes lists of one length, got ", owners.size(), ", ", keys.size(), ", ", n);
  for (int64_t i = 0; i < n; ++i) {
    PyObject* owner = PyList_GET_ITEM(owners.ptr(), i);
    PyObject* key = PyList_GET_ITEM(keys.ptr(), i);
    PyObject* now = PyDict_Check(owner) ? PyDict_GetItemWithError(owner, key) : nullptr;  // borrowed
    if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (now != PyList_GET_ITEM(tensors.ptr(), i)) return i;
  }
  return -1;
}

// Plan's structure, as tests and the Python side read it.
void bind_plan_structure(py::class_<Plan>& plan) {
  plan.def(py::init(&build_plan), py::arg("tensors"), py::arg("names"), py::arg("bucket_bytes"),
           py::arg("ring_depth"), py::arg("inplace_min_bytes"), py::arg("coalesce_bytes"), py::arg("rank"),
           py::arg("small_inplace_max") = 0)
      .def_property_readonly("num_inputs", [](const Plan& p) { return p.input_to_unique.size(); })
      .def_property_readonly("num_unique", [](const Plan& p) { return p.unique.size(); })
      .def_property_readonly("total_bytes", [](const Plan& p) { return p.total_bytes; })
      .def_property_readonly("packed_bytes", [](const Plan& p) { return p.packed_bytes; })
      .def_property_readonly("num_buckets", [](const Plan& p) { return p.buckets.size(); })
      .def_property_readonly("num_inplace", [](const Plan& p) {
        size_t n = 0;
        for (const auto& g : p.inplace_groups) n += g.size();
        return n;
      })
      .def_property_readonly("inplace_groups", [](const Plan& p) { return p.inplace_groups; })
      .def_property_readonly("inplace_ops", [](const Plan& p) { return p.inplace_ops; })
      .def_property_readonly("input_to_unique", [](const Plan& p) { return p.input_to_unique; })
      .def_property_readonly("unique_first_input", [](const Plan& p) {
        std::vector<int64_t> v;
        for (const auto& u : p.unique) v.push_back(u.first_input);
        return v;
      })
      .def_property_readonly("ring_slots", [](const Plan& p) { return p.ring_slots; })
      .def_property_readonly("slot_bytes", [](const Plan& p) { return p.slot_bytes; })
      .def_property_readonly("num_units_sent", [](const Plan& p) { return p.units_sent; })
      .def_property_readonly("num_scatter_runs", [](const Plan& p) { return p.scatter.size(); })
      .def_property_readonly("num_host_runs", [](const Plan& p) { return p.host_ops.size(); })
      .def_property_readonly("num_permute_runs", [](const Plan& p) { return p.permute.size(); })
      .def_property_readonly("chunk_slot_bytes", [](const Plan& p) { return p.chunk_slot_bytes; })
      .def_property_readonly("direct_buckets", [](const Plan& p) { return p.direct_buckets; });
}

// Plan's checks, layout and runs.
void bind_plan_runs(py::class_<Plan>& plan) {
  plan.def("describe", &Plan::describe, py::arg("input"))
      .def("fingerprint", &Plan::fingerprint)
      .def("routes", &Plan::routes)
      .def("digest", &Plan::digest)
      .def("check_unchanged", &Plan::check_unchanged, py::call_guard<py::gil_scoped_release>(),
           py::arg("inputs") = -1, py::arg("start") = 0,
           "'' while every input still holds the bytes, shape and dtype it was planned with; else what changed. "
           "inputs >= 0: only the first that many; start: the inputs before it are passed over")
      .def("inputs_of_buckets", &Plan::inputs_of_buckets, py::arg("n"),
           "how many inputs, from the first, hold every tensor that the first n buckets copy")
      .def("restrict_routes", &Plan::restrict_routes, py::arg("allowed"))
      .def("bucket_table", &bucket_table)
      .def_property_readonly("can_prepare", [](const Plan& p) { return can_prepare(p); })
      .def_readonly("layout_generation", &Plan::layout_generation, "bumped each time the buckets are laid out")
      .def(
          "prepare",
          [](const Plan& plan, bool is_src, bool pack, std::optional<at::Tensor> ring, Prepack* early) {
            py::gil_scoped_release release;
            return std::make_unique<PreparedRun>(plan, is_src, pack, ring.value_or(at::Tensor()), early);
          },
          py::arg("is_src"), py::arg("pack") = true, py::arg("ring") = py::none(), py::arg("early") = nullptr,
          py::keep_alive<0, 1>(),
          "the ring made (and on the source the first buckets packed unless not pack) before the agreement: for "
          "broadcast(). ring: one kept from an earlier run of this plan (PreparedRun.ring), not allocated anew. "
          "early: a load source's Prepack, its ring taken where it packed these buckets as this plan does, and "
          "used up either way")
      .def(
          "broadcast",
          [](const Plan& plan, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t src, double timeout_s,
             std::optional<py::function> progress, double progress_seconds, std::optional<py::function> hook,
             bool leave_host_reads, PreparedRun* prepared) -> py::tuple {
            const auto timeout = to_timeout(timeout_s);
            const auto h = as_hook(hook);
            Progress p;
            if (progress) {
              p.every = progress_seconds;
              p.report = [&progress](int64_t bytes) {
                py::gil_scoped_acquire gil;
                (*progress)(bytes);
              };
            }
            RunStats stats;
            {
              py::gil_scoped_release release;
              stats = broadcast_plan(plan, pg, src, timeout, p, h, leave_host_reads, prepared);
            }
            if (!leave_host_reads) {
              return py::make_tuple(stats.seconds, stats.ring_bytes, stats.host_ring_bytes, stats.host_batched_bytes);
            }
            return py::make_tuple(stats.seconds, stats.ring_bytes, stats.host_ring_bytes, stats.host_batched_bytes,
                                  stats.host_reads);
          },
          py::arg("group"), py::arg("src"), py::arg("timeout_s") = 0.0, py::arg("progress") = py::none(),
          py::arg("progress_seconds") = 0.0, py::arg("hook") = py::none(), py::arg("leave_host_reads") = false,
          py::arg("prepared") = nullptr,
          "Returns (host seconds, device ring bytes, pinned host ring bytes, host bytes sent up by batched copies). "
          "prepared: from prepare(), on the same plan and layout. With leave_host_reads, a fifth value: the copies of "
          "the source's host memory still running (HostReads, or None), for the caller to wait() on before it returns");
}

// The module walks a sync reads its tensors by, and a kept plan's check of them.
void bind_module_walks(py::module_& m) {
  m.def("module_slots", &module_slots, py::arg("module"), py::arg("include_buffers"), py::arg("dedupe"),
        "(owners, keys, tensors) of a module's parameters (and buffers) in named_parameters() order, or None "
        "where a module's dicts are not dicts (csrc/module_walk.h)");
  m.def("first_replaced", &first_replaced, py::arg("owners"), py::arg("keys"), py::arg("tensors"),
        "The first i with owners[i][keys[i]] not tensors[i], or -1");
}

}  // namespace

py::class_<Plan> bind_sync(py::module_& m) {
  py::class_<HostReads, std::shared_ptr<HostReads>>(
      m, "HostReads", "The copies of a load source's host memory still running after its broadcast returned")
      .def("wait", &HostReads::wait, py::call_guard<py::gil_scoped_release>(),
           "Until they are done; past the call's deadline raises (what they read is then kept)");
  py::class_<PreparedRun>(m, "PreparedRun",
                          "A sync's ring allocated, its table uploaded and (on the source) its first buckets packed "
                          "before the agreement (csrc/pipeline.h); dropped unused, what it queued is ordered "
                          "before the caller's stream and the ring freed")
      .def(
          "speculate",
          [](PreparedRun& run, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t src, double timeout_s) {
            py::gil_scoped_release release;
            return run.speculate(pg, src, to_timeout(timeout_s));
          },
          py::arg("group"), py::arg("src"), py::arg("timeout_s") = 0.0,
          "the first buckets broadcast ring slot to ring slot, before the agreement (every rank must): how many")
      .def_readonly("sent", &PreparedRun::sent)
      .def_readonly("packed", &PreparedRun::packed)
      .def_readonly("prepacked", &PreparedRun::prepacked, "of packed, the buckets taken from a Prepack")
      .def_property_readonly(
          "ring", [](const PreparedRun& run) { return run.arena; }, "the ring and copy table, one byte tensor");
  py::class_<Plan> plan(m, "Plan");
  bind_plan_structure(plan);
  bind_plan_runs(plan);
  m.def(
      "_copy_buckets",
      [](const Plan& plan, bool pack, const at::Tensor& slot, const std::vector<int64_t>& buckets) {
        // Test and bench hook: the plan's pack (tensors -> slot) or unpack (slot -> tensors) of each listed
        // bucket in turn, through the executor the broadcast uses (one upload of the table, the copy lane),
        // without any communication. Two plans over tensors of the same layout move a state from one set to
        // the other through it: the copy kernels both ways, on one device.
        TORCH_CHECK_VALUE(slot.device() == plan.device && slot.is_contiguous() &&
                              static_cast<int64_t>(slot.nbytes()) >= plan.slot_bytes,
                          "_copy_buckets: a contiguous slot of at least ", plan.slot_bytes, " bytes on ",
                          plan.device, ", got ", slot.nbytes(), " bytes on ", slot.device());
        for (const int64_t b : buckets) {
          TORCH_CHECK_VALUE(b >= 0 && b < static_cast<int64_t>(plan.buckets.size()), "_copy_buckets: a bucket of ",
                            plan.buckets.size(), ", got ", b);
        }
        py::gil_scoped_release release;
        c10::DeviceGuard guard(plan.device);
        auto exec = make_executor(plan);
        exec->begin();
        // Held until end() has ordered the caller's stream after the kernels that read it.
        const auto table = at::empty({exec->table_bytes()}, at::TensorOptions().dtype(at::kByte).device(plan.device));
        exec->set_table(table);
        for (const int64_t b : buckets) {
          if (pack) {
            exec->pack(b, slot);
          } else {
            exec->unpack(b, slot);
          }
        }
        exec->end();
      },
      py::arg("plan"), py::arg("pack"), py::arg("slot"), py::arg("buckets"));
  bind_module_walks(m);
  return plan;
}

}  // namespace coalesced_bcast

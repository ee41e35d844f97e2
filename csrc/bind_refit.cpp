// A refit's bindings: its sending plan and Plan.refit_send, the receivers'
// slot views, and the test hooks of its copies.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <optional>
#include <string>
#include <vector>

#include "bind.h"
#include "executor.h"
#include "pipeline.h"
#include "plan.h"
#include "refit_views.h"

namespace coalesced_bcast {
namespace {

// Test hooks: one bucket's refit copies, the chunk sizes.
void bind_refit_hooks(py::module_& m) {
  m.def(
      "_refit_copy",
      [](const Plan& plan, int64_t bucket, bool permute, const at::Tensor& src, const at::Tensor& dst) {
        // Test hook: one bucket's refit pack (permute=False: this rank's rows into `dst`, its chunk or the
        // slot) or the sender's permute (gathered chunks `src` into the slot `dst`), on the plan's device,
        // without any communication.
        TORCH_CHECK_VALUE(plan.is_refit && bucket >= 0 && bucket < static_cast<int64_t>(plan.buckets.size()),
                          "a refit plan's bucket, got ", bucket);
        c10::DeviceGuard guard(plan.device);
        auto exec = make_executor(plan);
        exec->begin();
        // Held until end() has ordered the caller's stream after the kernels that read it.
        const auto table = at::empty({exec->table_bytes()}, at::TensorOptions().dtype(at::kByte).device(plan.device));
        exec->set_table(table);
        exec->copy_runs(permute ? Runs::kPermute : Runs::kScatter, bucket,
                        permute ? reinterpret_cast<uintptr_t>(src.data_ptr()) : 0,
                        reinterpret_cast<uintptr_t>(dst.data_ptr()), Lane::kCopy);
        exec->end();
      },
      py::arg("plan"), py::arg("bucket"), py::arg("permute"), py::arg("src"), py::arg("dst"));
  m.def("_refit_chunk_bytes", [](const Plan& plan) {
    std::vector<int64_t> out;
    for (const auto& r : plan.refit) out.push_back(r.chunk_bytes);
    return out;
  });
}

}  // namespace

void bind_refit(py::module_& m, py::class_<Plan>& plan) {
  m.def(
      "refit_plan",
      [](const at::Tensor& units, std::vector<at::Tensor> locals, const std::vector<int64_t>& modes,
         int64_t trainer_rank, int64_t trainer_world, int64_t sender, int64_t bucket_bytes, int64_t ring_depth,
         int64_t rank, c10::Device device, std::vector<std::string> names, bool direct) {
        auto o = load_options(bucket_bytes, ring_depth, rank, device, /*whole_units=*/true);
        o.direct = direct;
        return make_refit_plan(units, std::move(locals), modes, std::move(names), trainer_rank, trainer_world, sender,
                               o);
      },
      py::arg("units"), py::arg("locals"), py::arg("modes"), py::arg("trainer_rank"), py::arg("trainer_world"),
      py::arg("sender"), py::arg("bucket_bytes"), py::arg("ring_depth"), py::arg("rank"), py::arg("device"),
      py::arg("names"), py::arg("direct") = true,
      "A refit's sending side on one trainer rank: its local tensors (whole on the sender, mode 0, or torch.chunk "
      "rows, mode 1) packed, cast to the units' dtypes, and gathered into the stream the receivers load");
  plan.def(
          "refit_send",
          [](const Plan& plan, const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& trainer,
             const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& refit, int64_t refit_src, double timeout_s,
             std::optional<py::function> hook) {
            const auto h = as_hook(hook);
            RunStats stats;
            {
              py::gil_scoped_release release;
              stats = refit_send(plan, trainer.value_or(nullptr), refit.value_or(nullptr), refit_src,
                                 to_timeout(timeout_s), h);
            }
            return std::make_tuple(stats.seconds, stats.ring_bytes);
          },
          py::arg("trainer"), py::arg("refit"), py::arg("refit_src"), py::arg("timeout_s") = 0.0,
          py::arg("hook") = py::none());
  m.def("bucket_units", &bucket_units, py::arg("units"), py::arg("bucket_bytes"), py::arg("whole") = false,
        "Per piece of a unit in a bucket: int64 [n, 5] of bucket, unit, first element, elements, byte offset");
  py::class_<SlotViews>(m, "SlotViews")
      .def(py::init<const at::Tensor&, const at::Tensor&, std::vector<py::object>>(), py::arg("units"),
           py::arg("rows"), py::arg("names") = std::vector<py::object>{})
      .def_property_readonly("num_buckets", &SlotViews::num_buckets)
      .def("views", &SlotViews::views, py::arg("bucket"), py::arg("slot"),
           "Views of the bucket's rows into its slot: whole units shaped, pieces flat")
      .def("batch", &SlotViews::batch, py::arg("bucket"), py::arg("slot"),
           "(pairs, pieces) of the bucket for a refit callback: (name, view), (name, flat view, first, shape)");
  bind_refit_hooks(m);
}

}  // namespace coalesced_bcast

// A load's bindings: its plans (made on threads of their own: pending.h), its
// model side (the walk, load_dests, the post-hooks' judgment), its source side
// (describe_tensors, the prepack) and the host stage's test hooks.
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "bind.h"
#include "chunks.h"
#include "dest_feed.h"
#include "host_stage.h"
#include "load_dests.h"
#include "module_walk.h"
#include "pending.h"
#include "pipeline.h"
#include "plan.h"
#include "post_hooks.h"
#include "tensor_list.h"
#include "units.h"

namespace coalesced_bcast {
namespace {

// load_plan and the plans made on threads of their own.
void bind_load_plans(py::module_& m) {
  m.def(
      "load_plan",
      [](const at::Tensor& units, const py::object& sources, const py::object& dests, const at::Tensor& dest_meta,
         int64_t bucket_bytes, int64_t ring_depth, int64_t rank, int64_t copy_threads, c10::Device device,
         bool whole_units, bool kept, bool direct) {
        auto o = load_options(bucket_bytes, ring_depth, rank, device, whole_units);
        o.copy_threads = copy_threads;
        o.kept = kept;
        o.direct = direct;
        return make_load_plan(units, tensors_of(sources), tensors_of(dests), dest_meta, o);
      },
      py::arg("units"), py::arg("sources"), py::arg("dests"), py::arg("dest_meta"), py::arg("bucket_bytes"),
      py::arg("ring_depth"), py::arg("rank"), py::arg("copy_threads"), py::arg("device"),
      py::arg("whole_units") = false, py::arg("kept") = false, py::arg("direct") = true,
      "A load's plan: checkpoint tensors (units: dtype, ndim, sizes) streamed into this rank's shards (dests); "
      "sources and dests are lists of tensors or TensorLists, whose tensors the plan takes (they are left empty)");
  py::class_<PendingPlan>(m, "PendingPlan", "A load plan being made on a thread of its own")
      .def("result", &PendingPlan::result, "The plan, once made (waits for it)")
      .def("done", &PendingPlan::done, "Whether the plan is made (result() returns at once)")
      .def("close", &PendingPlan::close, py::arg("use"),
           "A fed plan: no more destinations; use: whether the plan is wanted")
      .def("dests", &PendingPlan::dests,
           "A fed plan closed unused, after result(): the destinations load_dests put in it, as a TensorList")
      .def_property_readonly("used", &PendingPlan::used,
                             "Whether a fed plan was closed wanted, with every destination as load_dests found it");
  m.def(
      "start_load_plan",
      [](const at::Tensor& units, const py::object& sources, const py::object& dests, const at::Tensor& dest_meta,
         int64_t bucket_bytes, int64_t ring_depth, int64_t rank, int64_t copy_threads, c10::Device device) {
        auto o = load_options(bucket_bytes, ring_depth, rank, device, /*whole_units=*/false);
        o.copy_threads = copy_threads;
        return std::make_unique<PendingPlan>(
            [units, src = tensors_of(sources), dst = tensors_of(dests), dest_meta, o]() mutable {
              return make_load_plan(units, std::move(src), std::move(dst), dest_meta, o);
            });
      },
      py::arg("units"), py::arg("sources"), py::arg("dests"), py::arg("dest_meta"), py::arg("bucket_bytes"),
      py::arg("ring_depth"), py::arg("rank"), py::arg("copy_threads"), py::arg("device"),
      "load_plan on a thread of its own: a PendingPlan, whose result() is the plan");
  m.def(
      "start_fed_load_plan",
      [](const at::Tensor& table, const py::object& sources, int64_t capacity, int64_t bucket_bytes,
         int64_t ring_depth, int64_t rank, int64_t copy_threads, c10::Device device) {
        auto o = load_options(bucket_bytes, ring_depth, rank, device, /*whole_units=*/false);
        o.copy_threads = copy_threads;
        TORCH_CHECK_VALUE(capacity >= 0, "capacity must be at least 0, got ", capacity);
        auto feed = std::make_shared<DestFeed>(capacity);
        // A TensorList's tensors are read in place, copied on the thread (they stay the caller's, for the
        // plan the caller makes where this one is not used); a list's are converted here.
        const bool in_place = py::isinstance<TensorList>(sources);
        const std::vector<at::Tensor>* view = in_place ? &sources.cast<TensorList&>().tensors : nullptr;
        std::vector<at::Tensor> converted = in_place ? std::vector<at::Tensor>{} : tensors_from(sources, "item");
        return std::make_unique<PendingPlan>(
            [table, view, converted = std::move(converted), feed, o]() mutable -> std::optional<Plan> {
              if (view != nullptr) return make_fed_load_plan(table, *view, *feed, o);  // copied here, on the thread
              return make_fed_load_plan(table, std::move(converted), *feed, o);
            },
            feed, in_place ? sources : py::none());
      },
      py::arg("table"), py::arg("sources"), py::arg("capacity"), py::arg("bucket_bytes"), py::arg("ring_depth"),
      py::arg("rank"), py::arg("copy_threads"), py::arg("device"),
      "load_plan of the table's rows in order, on a thread of its own, its destinations fed by load_dests "
      "(feed=) as it finds them: a PendingPlan to close(use) once load_dests returns; result() is None unless "
      "used (csrc/dest_feed.h)");
}

// The model side: the walk, the values' destinations, the post-hooks.
void bind_load_model(py::module_& m) {
  m.def("load_walk", &load_walk, py::arg("module"), py::arg("base"), py::arg("extra_key"),
        "(extra-state keys -> modules, ids of parameters and buffers) as state_dict() walks, or None "
        "(csrc/module_walk.h)");
  m.def("load_dests",
        [](const py::list& values, const at::Tensor& rows, const at::Tensor& table, const at::Tensor& canon_rows,
           const IdSet& owned_ids, const py::handle& dtensor_type, const py::handle& shard_type,
           const py::handle& replicate_type, const py::function& mesh_facts, const py::function& nd_box,
           c10::Device device, int64_t rank, bool scalar_from_any_1dim, PendingPlan* feed) {
          TORCH_CHECK_VALUE(feed == nullptr || feed->feed() != nullptr, "feed must be a fed plan (start_fed_load_plan)");
          return load_dests(values, rows, table, canon_rows, owned_ids, dtensor_type, shard_type, replicate_type,
                            mesh_facts, nd_box, device, rank, scalar_from_any_1dim,
                            feed != nullptr ? feed->feed() : nullptr);
        },
        py::arg("values"), py::arg("rows"), py::arg("table"), py::arg("canon_rows"),
        py::arg("owned_ids"), py::arg("dtensor_type"), py::arg("shard_type"), py::arg("replicate_type"),
        py::arg("mesh_facts"), py::arg("nd_box"), py::arg("device"), py::arg("rank"), py::arg("scalar_from_any_1dim"),
        py::arg("feed") = py::none(),
        "A load's model side: per kept state-dict value its unit, this rank's local tensor and box offset, the "
        "keys cast, and what is wrong (csrc/load_dests.h)");
  m.attr("key_mark") = kKeyMark;
  m.def("first_device", &first_device, py::arg("values"), py::arg("dtensor_type"),
        "The device of the first tensor (DTensors: local tensor) with elements or on meta, and its index (-1: none)");
  m.def("idle_fsdp_hook", &idle_fsdp_hook, py::arg("module"), py::arg("hook"),
        "Whether a load_state_dict post-hook is FSDP2's and would do nothing after an in-place load "
        "(csrc/post_hooks.h)");
  m.def("post_hooks_idle", &post_hooks_idle, py::arg("model"),
        "Whether every load_state_dict post-hook of the model and its children is idle_fsdp_hook");
  py::class_<HookJudgment>(m, "HookJudgment", "post_hooks_idle in steps (the modules walked when made)")
      .def(py::init<const py::handle&>(), py::arg("model"))
      .def("step", &HookJudgment::step, py::arg("count"),
           "Up to count more hooks judged: the verdict once known, else None")
      .def("verdict", &HookJudgment::verdict, "The rest judged: whether every hook is idle_fsdp_hook");
}

// The source side: its tensors described (on a thread), its first buckets packed early.
void bind_load_source(py::module_& m) {
  m.def(
      "describe_tensors",
      [](const py::handle& list, c10::Device device) {
        auto tensors = tensors_from(list, "tensor");
        auto [table, canon, problems] = describe_tensors(tensors, device);
        return std::make_tuple(table, canon, problems, TensorList{std::move(tensors)});
      },
      py::arg("tensors"), py::arg("device"),
      "A load source's tensors: (table int64 [n, 2 + 8] of dtype, ndim, sizes; canonical index of each; "
      "[(index, why)] for those that cannot be sent; the tensors as a TensorList, for load_plan)");
  py::class_<PendingDescribe>(m, "PendingDescribe",
                              "describe_tensors on a thread, started before the model's device is known")
      .def("result", &PendingDescribe::result, py::arg("device"),
           "describe_tensors' tuple, once the thread is done, with the device check made against `device`");
  m.def(
      "start_describe",
      [](const py::handle& list) { return std::make_unique<PendingDescribe>(tensors_from(list, "tensor")); },
      py::arg("tensors"), "describe_tensors(tensors, device) begun on a thread: result(device) gives its tuple");
  py::class_<Prepack>(m, "Prepack",
                      "A load source's first buckets packed into a ring from the checkpoint's host memory while it "
                      "still plans (csrc/prepack.cpp), for Plan.prepare(early=); dropped unused, it waits for its "
                      "copies and frees its ring");
  m.def(
      "prepack_load",
      [](const at::Tensor& table, const at::Tensor& canon, const std::optional<at::Tensor>& rows,
         const py::object& sources, int64_t bucket_bytes, int64_t ring_depth, int64_t rank, int64_t copy_threads,
         c10::Device device) -> std::unique_ptr<Prepack> {
        if (!py::isinstance<TensorList>(sources)) return nullptr;
        const auto& list = sources.cast<TensorList&>().tensors;  // read, not taken: the plan takes them later
        auto o = load_options(bucket_bytes, ring_depth, rank, device, /*whole_units=*/false);
        o.copy_threads = copy_threads;
        py::gil_scoped_release release;
        return prepack_load(table, canon, rows.value_or(at::Tensor()), list, o);
      },
      py::arg("table"), py::arg("canon"), py::arg("rows"), py::arg("sources"), py::arg("bucket_bytes"),
      py::arg("ring_depth"), py::arg("rank"), py::arg("copy_threads"), py::arg("device"),
      "The source's first buckets packed before its load plan is made (a Prepack), or None where there is nothing "
      "to win (a CPU load, sources on the device)");
}

// Test hooks of the host stage (host_stage.h).
void bind_host_stage(py::module_& m) {
  m.def(
      "_host_stage",
      [](const std::vector<at::Tensor>& tensors, int64_t threads) {
        // Test hook: the host stage's threaded pack of `tensors` (CPU, any strides) back to back
        // (16-byte aligned) into one buffer, as a load's source packs a bucket; and the shares it
        // was cut into.
        std::vector<CopyOp> ops;
        std::vector<Layout> layouts;
        int64_t offset = 0;
        for (const auto& t : tensors) {
          TORCH_CHECK_VALUE(t.is_cpu(), "_host_stage takes CPU tensors");
          offset = align_up(offset, kAlign);
          int32_t layout = -1;
          if (!t.is_contiguous()) {
            layouts.push_back(collapse_layout(t, [] { return std::string("a test tensor"); }));
            layout = static_cast<int32_t>(layouts.size() - 1);
          }
          const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
          if (nbytes > 0) {
            ops.push_back(CopyOp{reinterpret_cast<uint64_t>(t.data_ptr()), 0, offset, nbytes, layout,
                                 static_cast<int32_t>(t.element_size())});
          }
          offset += nbytes;
        }
        auto bucket = at::zeros({offset}, at::kByte);
        HostStager stager(threads);
        stager.stage(ops.data(), static_cast<int64_t>(ops.size()), layouts, bucket.data_ptr<uint8_t>());
        return std::make_tuple(bucket, stager.last_shares());
      },
      py::arg("tensors"), py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_host_scatter",
      [](const Plan& plan, const at::Tensor& stream, int64_t threads) {
        // Test hook: a load plan's scatter runs written out by the host stage's threads, bucket k read
        // from byte k * bucket_bytes of `stream` (the checkpoint's byte stream), as a rank with pageable
        // host shards writes them out of each bucket's pinned copy; the most shares a bucket was cut into.
        TORCH_CHECK_VALUE(plan.is_load && stream.is_cpu() && stream.scalar_type() == at::kByte &&
                              stream.is_contiguous(), "_host_scatter takes a load plan and a contiguous uint8 CPU stream");
        const int64_t B = plan.options.bucket_bytes;
        TORCH_CHECK_VALUE(stream.numel() >= static_cast<int64_t>(plan.buckets.size()) * B, "a stream of ",
                          stream.numel(), " bytes for ", plan.buckets.size(), " buckets of ", B);
        HostStager stager(threads);
        int64_t most = 0;
        for (size_t k = 0; k < plan.buckets.size(); ++k) {
          const auto& b = plan.buckets[k];
          stager.scatter(plan.scatter.data() + b.first_scatter, b.num_scatter, plan.boxes,
                         stream.data_ptr<uint8_t>() + static_cast<int64_t>(k) * B);
          most = std::max(most, stager.last_shares());
        }
        return most;
      },
      py::arg("plan"), py::arg("stream"), py::arg("threads"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_load(py::module_& m) {
  bind_load_plans(m);
  bind_load_model(m);
  bind_load_source(m);
  bind_host_stage(m);
}

}  // namespace coalesced_bcast

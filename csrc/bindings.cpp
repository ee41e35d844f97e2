// The compiled module is one thin layer: a Plan built from tensors, its
// structure for the Python side (agreement, tests), and broadcast().
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include <torch/csrc/autograd/python_variable.h>

#include "chunks.h"
#include "dest_feed.h"
#include "executor.h"
#include "host_stage.h"
#include "host_wait.h"
#include "load_dests.h"
#include "module_walk.h"
#include "pipeline.h"
#include "post_hooks.h"
#include "refit_views.h"
#include "plan.h"
#include "tensor_list.h"
#include "units.h"
#include "verify.h"

namespace py = pybind11;
using namespace coalesced_bcast;

namespace {

// The tensors of a Python list or tuple's items, in one pass that prefetches
// ahead: each item's PyObject, then (where `touch_impl`: taking a reference
// writes there) the TensorImpl it holds. pybind's own conversion touches one
// cold object after the other and waits on memory at each (a model's tensors
// were made between other allocations). One H200, 16k and 64k GPU tensors,
// caches swept first: a plan from a list 255-294 -> 170-269 ns a tensor at the median.
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

std::vector<at::Tensor> tensors_from(const py::handle& seq, const char* what) {
  PyObject* o = seq.ptr();
  if (!PyList_Check(o) && !PyTuple_Check(o)) return seq.cast<std::vector<at::Tensor>>();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  std::vector<at::Tensor> out;
  out.reserve(n);
  for_tensor_items(PySequence_Fast_ITEMS(o), n, what, true, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

// The same, borrowing (tensor_refs.h): the plan keeps a tuple of the items (a
// snapshot: the caller may change its list), which owns every impl.
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

LoadOptions load_options(int64_t bucket_bytes, int64_t ring_depth, int64_t rank, c10::Device device, bool whole_units) {
  LoadOptions o;
  o.bucket_bytes = bucket_bytes;
  o.ring_depth = ring_depth;
  o.rank = rank;
  o.device = device;
  o.whole_units = whole_units;
  return o;
}

// A list of tensors, or a TensorList's tensors, taken out of it (it is single-use).
std::vector<at::Tensor> tensors_of(const py::handle& h) {
  if (py::isinstance<TensorList>(h)) return std::move(h.cast<TensorList&>().tensors);
  return tensors_from(h, "item");
}

// Joins a helper thread, without the GIL where this thread holds it: the helper may take it (to let
// tensors go), and a caller waiting on it must not hold it meanwhile.
void join_without_gil(std::thread& thread) {
  if (!thread.joinable()) return;
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    thread.join();
  } else {
    thread.join();
  }
}

// A load's plan made on a thread of its own while the caller goes on (state_dict.py judges FSDP2's
// post-hooks meanwhile, under the GIL: at 16k keys each costs ~10 ms). The arguments were converted
// under the GIL; planning reads only tensors. result() waits without the GIL and raises what planning
// raised. A fed plan (dest_feed.h) takes its destinations from load_dests as it finds them: close() says
// that no more come and whether the plan is wanted; result() is then None where it is not.
class PendingPlan {
 public:
  explicit PendingPlan(std::function<std::optional<Plan>()> make, std::shared_ptr<DestFeed> feed = nullptr,
                       py::object keep = py::none())
      : feed_(std::move(feed)), keep_(std::move(keep)), thread_([this, make = std::move(make)] {
          try {
            plan_ = make();
          } catch (...) {
            error_ = std::current_exception();
          }
          done_.store(true, std::memory_order_release);
        }) {}
  PendingPlan(const PendingPlan&) = delete;
  PendingPlan& operator=(const PendingPlan&) = delete;
  // Whether result() would return at once.
  bool done() const { return done_.load(std::memory_order_acquire); }
  ~PendingPlan() {  // one dropped unread: joined without the GIL, which the thread may take to let tensors go
    if (feed_) feed_->close(false);  // a fed plan left open (load_dests raised): its thread waits no more
    join_without_gil(thread_);
  }
  DestFeed* feed() const { return feed_.get(); }
  void close(bool use) {
    TORCH_CHECK_VALUE(feed_ != nullptr, "close() is for a fed plan (start_fed_load_plan)");
    feed_->close(use);
  }
  bool used() const { return feed_ != nullptr && feed_->used(); }
  // A fed plan closed unused, once result() returned: the destinations load_dests put in the feed (it kept
  // no list of its own), for the plan made as before.
  TensorList dests() {
    TORCH_CHECK_VALUE(feed_ != nullptr && feed_->closed() && !feed_->used() && taken_,
                      "dests() is for a fed plan closed unused, after its result()");
    TORCH_CHECK_VALUE(!dests_taken_, "a fed plan's dests() are taken once");
    dests_taken_ = true;
    return TensorList{feed_->take_put()};
  }

  std::optional<Plan> result() {
    TORCH_CHECK_VALUE(feed_ == nullptr || feed_->closed(), "a fed plan's result is taken after close()");
    join_without_gil(thread_);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    TORCH_CHECK_VALUE(!taken_, "a pending plan's result is taken once");
    taken_ = true;
    return std::move(plan_);
  }

 private:
  std::shared_ptr<DestFeed> feed_;
  py::object keep_;  // what the thread reads in place (a fed plan's sources), alive until it is joined
  std::optional<Plan> plan_;
  std::exception_ptr error_;
  bool taken_ = false;
  bool dests_taken_ = false;
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it starts once the members it writes exist
};

// A load source's describe_tensors on a thread of its own, started before the model's device is known:
// the source's tensors are read while the caller reads the model's state (state_dict.py). The list was
// converted under the GIL; the thread reads only tensors (no Python object, no reference let go).
// result(device) waits without the GIL and makes the device check.
class PendingDescribe {
 public:
  explicit PendingDescribe(std::vector<at::Tensor> tensors)
      : tensors_(std::move(tensors)), thread_([this] {
          try {
            out_ = describe_tensors(tensors_, std::nullopt, &on_device_);
          } catch (...) {
            error_ = std::current_exception();
          }
        }) {}
  PendingDescribe(const PendingDescribe&) = delete;
  PendingDescribe& operator=(const PendingDescribe&) = delete;
  ~PendingDescribe() {  // dropped unread: joined without the GIL; the tensors are let go with it after
    join_without_gil(thread_);
  }
  py::tuple result(c10::Device device) {
    TORCH_CHECK_VALUE(!taken_, "a pending description's result is taken once");
    join_without_gil(thread_);
    taken_ = true;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    auto& [table, canon, problems] = out_;
    check_source_devices(tensors_, on_device_, device, table, canon, problems);
    return py::make_tuple(table, canon, problems, TensorList{std::move(tensors_)});
  }

 private:
  std::vector<at::Tensor> tensors_;
  std::tuple<at::Tensor, at::Tensor, std::vector<std::pair<int64_t, std::string>>> out_;
  std::vector<int64_t> on_device_;
  std::exception_ptr error_;
  bool taken_ = false;
  std::thread thread_;  // last: it starts once the members it writes exist
};

std::chrono::milliseconds to_timeout(double seconds) {
  return seconds > 0 ? std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)) : c10d::kUnsetTimeout;
}

// A Python callable as a BucketHook: called with the GIL, from inside the transfer.
BucketHook as_hook(const std::optional<py::function>& fn) {
  if (!fn) return {};
  return [fn](int64_t bucket, const at::Tensor& slot) {
    py::gil_scoped_acquire gil;
    (*fn)(bucket, slot);
  };
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "coalesced_bcast core: plan -> buckets -> pack -> broadcast -> unpack";
  m.attr("with_cuda") = py::bool_(
#ifdef WITH_CUDA
      true
#else
      false
#endif
  );
  m.def("hash_words", &hash_words, py::arg("words"));
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
  m.attr("fingerprint_header") = kFingerprintHeader;
  m.attr("fingerprint_record") = kFingerprintRecord;
  m.def("hash_tensors", &hash_tensors,
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
        "Per tensor a 64-bit hash of its bytes in logical order, then their digest (int64, on the tensors' device)");
  m.def("_check_corrupted_table", &check_corrupted_table, py::arg("plan"), py::arg("what"),
        "Test hook: validate_copy_table's message for a copy of the plan with one corrupted field ('' if none)");
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
  m.def(
      "load_plan",
      [](const at::Tensor& units, const py::object& sources, const py::object& dests, const at::Tensor& dest_meta,
         int64_t bucket_bytes, int64_t ring_depth, int64_t rank, int64_t copy_threads, c10::Device device,
         bool whole_units, bool kept) {
        auto o = load_options(bucket_bytes, ring_depth, rank, device, whole_units);
        o.copy_threads = copy_threads;
        o.kept = kept;
        return make_load_plan(units, tensors_of(sources), tensors_of(dests), dest_meta, o);
      },
      py::arg("units"), py::arg("sources"), py::arg("dests"), py::arg("dest_meta"), py::arg("bucket_bytes"),
      py::arg("ring_depth"), py::arg("rank"), py::arg("copy_threads"), py::arg("device"),
      py::arg("whole_units") = false, py::arg("kept") = false,
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
        // plan made as before where this one is not used); a list's are converted here.
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
  m.def(
      "refit_plan",
      [](const at::Tensor& units, std::vector<at::Tensor> locals, const std::vector<int64_t>& modes,
         int64_t trainer_rank, int64_t trainer_world, int64_t sender, int64_t bucket_bytes, int64_t ring_depth,
         int64_t rank, c10::Device device, std::vector<std::string> names) {
        return make_refit_plan(units, std::move(locals), modes, std::move(names), trainer_rank, trainer_world, sender,
                               load_options(bucket_bytes, ring_depth, rank, device, /*whole_units=*/true));
      },
      py::arg("units"), py::arg("locals"), py::arg("modes"), py::arg("trainer_rank"), py::arg("trainer_world"),
      py::arg("sender"), py::arg("bucket_bytes"), py::arg("ring_depth"), py::arg("rank"), py::arg("device"),
      py::arg("names"),
      "A refit's sending side on one trainer rank: its local tensors (whole on the sender, mode 0, or torch.chunk "
      "rows, mode 1) packed, cast to the units' dtypes, and gathered into the stream the receivers load");
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
  m.def("_refit_chunk_bytes", [](const Plan& plan) {
    std::vector<int64_t> out;
    for (const auto& r : plan.refit) out.push_back(r.chunk_bytes);
    return out;
  });
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
  m.def("module_slots", &module_slots, py::arg("module"), py::arg("include_buffers"), py::arg("dedupe"),
        "(owners, keys, tensors) of a module's parameters (and buffers) in named_parameters() order, or None "
        "where a module's dicts are not dicts (csrc/module_walk.h)");
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
  m.def("load_walk", &load_walk, py::arg("module"), py::arg("base"), py::arg("extra_key"),
        "(extra-state keys -> modules, ids of parameters and buffers) as state_dict() walks, or None "
        "(csrc/module_walk.h)");
  m.def("first_replaced", &first_replaced, py::arg("owners"), py::arg("keys"), py::arg("tensors"),
        "The first i with owners[i][keys[i]] not tensors[i], or -1");
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
  py::class_<Plan>(m, "Plan")
      .def(py::init(&build_plan), py::arg("tensors"), py::arg("names"), py::arg("bucket_bytes"),
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
      .def_property_readonly("direct_buckets", [](const Plan& p) { return p.direct_buckets; })
      .def(
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
          py::arg("hook") = py::none())
      .def("describe", &Plan::describe, py::arg("input"))
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

// load dests: per kept state-dict value, the checks and the box arithmetic
// that ran per key in Python (7 us a key on the CPU machine at 16k keys, most
// of a load's own host time) as attribute reads and integer math here.
#include "load_dests.h"

#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <sstream>
#include <unordered_map>

#if __has_include(<torch/csrc/distributed/Placement.h>)
#include <torch/csrc/distributed/Placement.h>
#define COALESCED_BCAST_CPP_SHARD 1
#endif

#include "cast.h"
#include "chunks.h"
#include "copy_table.h"
#include "tensor_list.h"

namespace coalesced_bcast {
namespace {

constexpr int64_t kWidth = 2 + kMaxDims;  // a table row: dtype, ndim, sizes

struct MeshFacts {
  bool member;
  int64_t coord;  // on a 1-D mesh
  int64_t ndim;
  int64_t size;   // of a 1-D mesh
};

// As Python prints a tuple of ints: (3, 4), (3,), ().
template <typename Sizes>
std::string tuple_str(const Sizes& sizes) {
  std::ostringstream s;
  s << "(";
  for (size_t d = 0; d < sizes.size(); ++d) s << (d ? ", " : "") << sizes[d];
  s << (sizes.size() == 1 ? ",)" : ")");
  return s.str();
}

std::string py_str(const py::handle& h) {
  return py::str(h).cast<std::string>();
}

// obj.name through an interned string made once: a name made per call costs
// its allocation and hashing, most of an attribute read.
py::object attr(const py::handle& obj, const char* name) {
  static std::unordered_map<const char*, PyObject*> interned;
  auto& s = interned[name];
  if (s == nullptr) s = PyUnicode_InternFromString(name);
  PyObject* v = PyObject_GetAttr(obj.ptr(), s);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// Shard(d)'s d. Where torch keeps placements in C++ (torch._C._distributed.Shard), from the
// object's C++ value: pybind's property read cost more than the rest of a key's box arithmetic
// (13% of this pass on the CPU machine at 16k keys). Else, or for an object laid out otherwise,
// by name.
int64_t shard_dim(const py::object& p) {
#ifdef COALESCED_BCAST_CPP_SHARD
  static const pybind11::detail::type_info* cpp = pybind11::detail::get_type_info(typeid(torch::distributed::Shard));
  if (cpp != nullptr && PyType_IsSubtype(Py_TYPE(p.ptr()), cpp->type)) {
    const auto* inst = reinterpret_cast<const pybind11::detail::instance*>(p.ptr());
    if (inst->simple_layout && inst->simple_holder_constructed && inst->simple_value_holder[0] != nullptr) {
      return static_cast<const torch::distributed::Shard*>(inst->simple_value_holder[0])->dim;
    }
  }
#endif
  return attr(p, "dim").cast<int64_t>();
}

// What a value's Python objects say, read in stages (below).
struct ValueFacts {
  bool tensor = false;   // a torch.Tensor (else extra state or a hook's object)
  bool owned = false;    // one of the model's own parameters or buffers
  bool dtensor = false;
  PyObject* local_seen = nullptr;  // a DTensor's local tensor and spec as read from their slots, not yet held
  PyObject* spec_seen = nullptr;
  PyObject* first_seen = nullptr;  // placements[0], not yet held
  py::object local;      // a DTensor's: its local tensor, spec, mesh, placements, placements[0]
  py::object spec;
  py::object mesh;
  py::object placements;
  py::object first;
};

// Values are read kGroup at a time, each group's chain one hop per stage (below).
constexpr int64_t kGroup = 16;

// Where a type keeps an object-valued __slots__ attribute (a DTensor's
// _local_tensor and _spec): the slot's byte offset, or -1 where the attribute
// must be read by name (not a plain slot of this type, or a type that reads
// attributes its own way). Found once per type; the type is held, so that no
// other type takes its address while it is remembered.
class ObjectSlot {
 public:
  explicit ObjectSlot(const char* name) : name_(PyUnicode_InternFromString(name)) {}

  // The slot's value, borrowed and untouched (its refcount not read or
  // written: reading it costs only the owner's line), or null: then attr().
  PyObject* peek(PyObject* obj) {
    PyTypeObject* t = Py_TYPE(obj);
    if (reinterpret_cast<PyObject*>(t) != type_.ptr()) {
      type_ = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(t));
      offset_ = -1;
      PyObject* d = t->tp_getattro == PyObject_GenericGetAttr ? _PyType_Lookup(t, name_) : nullptr;  // borrowed
      if (d != nullptr && Py_TYPE(d) == &PyMemberDescr_Type) {
        const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
        if (m->type == T_OBJECT_EX) offset_ = m->offset;
      }
    }
    return offset_ < 0 ? nullptr : *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset_);
  }
 private:
  PyObject* name_;
  py::object type_;
  Py_ssize_t offset_ = -1;
};

// The attribute values of an object whose type keeps its instance attributes
// in a managed dict (a DTensorSpec, a dataclass): where the interpreter keeps
// them in an array apart from the object (3.11 and 3.12, its pointer before
// the object; 3.12 tags it), that array's line, so that reading mesh and
// placements by name finds it in the cache. A hint only: other versions'
// layouts are skipped.
inline void prefetch_instance_values(PyObject* o) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
  if (!(Py_TYPE(o)->tp_flags & Py_TPFLAGS_MANAGED_DICT)) return;
  const auto word = *(reinterpret_cast<uintptr_t*>(o) - (PY_VERSION_HEX < 0x030C0000 ? 4 : 3));
#if PY_VERSION_HEX < 0x030C0000
  if (word != 0) __builtin_prefetch(reinterpret_cast<const void*>(word));
#else
  if (word & 1) __builtin_prefetch(reinterpret_cast<const void*>(word + 1));  // values (kept as pointer - 1)
#endif
#else
  (void)o;
#endif
}

// Shard(d)'s C++ value (torch._C._distributed.Shard, where torch keeps
// placements in C++; torch's Python Shard subclasses it), which shard_dim
// reads: its line.
inline void prefetch_shard(PyObject* p) {
#ifdef COALESCED_BCAST_CPP_SHARD
  static const pybind11::detail::type_info* cpp = pybind11::detail::get_type_info(typeid(torch::distributed::Shard));
  if (cpp == nullptr || !PyType_IsSubtype(Py_TYPE(p), cpp->type)) return;
  const auto* inst = reinterpret_cast<const pybind11::detail::instance*>(p);
  if (inst->simple_layout && inst->simple_holder_constructed) __builtin_prefetch(inst->simple_value_holder[0]);
#else
  (void)p;
#endif
}

// The bytes of each object that a stage reads (a hint: an object laid out
// otherwise is read all the same, from memory): a value's head and its
// DTensor slots (_local_tensor, _spec: 48 and 56 on torch 2.x, in a 64-byte
// object); a local tensor's head (its TensorImpl pointer at 16); a spec's
// managed-dict pointer before it (3.11, 3.12) and its head; a tuple's first
// item (at 24); a pybind11 instance's holder and flags (through 48).
constexpr int64_t kValueBytes = 64, kLocalBytes = 24, kSpecBefore = 32, kSpecBytes = 16, kTupleBytes = 32,
                  kPybindBytes = 56;

// The facts of the values, read as a pipeline over groups of kGroup: each
// stage takes one hop of a group's chains (value -> local tensor and spec ->
// mesh and placements -> placements[0] -> Shard's value, and the TensorImpls),
// prefetching what the next stage reads, and a group's next stage runs a whole
// group's work later, so that its lines have arrived (at 16k values, cold, a
// group's stages run back to back waited on memory at most hops: load_dests's
// loads after each prefetch were most of its time on the CPU machine). A hop's
// objects are held (their refcounts written) only in the stage after the one
// that prefetched them; each value's are let go right after it is used, while
// they are in the cache (held to the end, their refcounts were misses again).
class FactsReader {
 public:
  static constexpr int kStages = 6;

  FactsReader(const py::list& values, const IdSet& owned_ids, const py::handle& dtensor_type)
      : values_(values), owned_(owned_ids), dtensor_(dtensor_type),
        n_(static_cast<int64_t>(values.size())), facts_(n_) {}

  // Runs stage k of group g + kStages - k for every k: group g's facts were completed by the call
  // before (its last stage's prefetches have had a group's work to arrive). Call for g from -kStages.
  void advance(int64_t g) {
    for (int k = 0; k < kStages; ++k) {
      const int64_t h = g + kStages - k;
      const int64_t b = h * kGroup, e = std::min(n_, b + kGroup);
      if (h < 0 || b >= n_) continue;
      switch (k) {
        case 0: stage_values(b, e); break;
        case 1: stage_slots(b, e); break;
        case 2: stage_held(b, e); break;
        case 3: stage_spec(b, e); break;
        case 4: stage_first(b, e); break;
        default: stage_shard(b, e); break;
      }
    }
  }

  const ValueFacts& operator[](int64_t i) const { return facts_[i]; }
  void release(int64_t i) { facts_[i] = ValueFacts{}; }
  int64_t groups() const { return (n_ + kGroup - 1) / kGroup; }

 private:
  PyObject* item(int64_t i) const { return PyList_GET_ITEM(values_.ptr(), i); }

  void stage_values(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      prefetch_bytes(item(i), 0, kValueBytes);
      owned_.prefetch(reinterpret_cast<uintptr_t>(item(i)));
    }
  }

  void stage_slots(int64_t b, int64_t e) {
    // Never destroyed: a static's destructor would run after the interpreter is gone.
    static auto& local_slot = *new ObjectSlot("_local_tensor");
    static auto& spec_slot = *new ObjectSlot("_spec");
    for (int64_t i = b; i < e; ++i) {
      PyObject* v = item(i);
      auto& f = facts_[i];
      f.tensor = THPVariable_Check(v);
      if (!f.tensor) continue;
      f.owned = owned_.contains(reinterpret_cast<uintptr_t>(v));
      const int is_dtensor = PyObject_IsInstance(v, dtensor_.ptr());
      if (is_dtensor < 0) throw py::error_already_set();
      f.dtensor = is_dtensor == 1;
      if (!f.dtensor) continue;
      PyObject* l = local_slot.peek(v);
      PyObject* s = spec_slot.peek(v);
      if (l != nullptr && s != nullptr) {
        prefetch_bytes(f.local_seen = l, 0, kLocalBytes);
        prefetch_bytes(f.spec_seen = s, -kSpecBefore, kSpecBytes);
      } else {  // read by name, as Python would
        f.local = attr(v, "_local_tensor");
        f.spec = attr(v, "_spec");
      }
    }
  }

  void stage_held(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      if (f.local_seen != nullptr) {
        f.local = py::reinterpret_borrow<py::object>(f.local_seen);
        f.spec = py::reinterpret_borrow<py::object>(f.spec_seen);
        prefetch_instance_values(f.spec_seen);  // mesh and placements, read by name in the next stage
      }
      if (f.tensor) prefetch_impl(THPVariable_Unpack(item(i)).unsafeGetTensorImpl());  // its (global) shape
      if (f.local && THPVariable_Check(f.local.ptr())) prefetch_impl(THPVariable_Unpack(f.local.ptr()).unsafeGetTensorImpl());
    }
  }

  void stage_spec(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      if (!f.spec) continue;
      f.mesh = attr(f.spec, "mesh");
      f.placements = attr(f.spec, "placements");
      prefetch_bytes(f.placements.ptr(), 0, kTupleBytes);
    }
  }

  void stage_first(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      PyObject* p = f.placements.ptr();
      f.first_seen = p != nullptr && PyTuple_Check(p) && PyTuple_GET_SIZE(p) > 0 ? PyTuple_GET_ITEM(p, 0) : nullptr;
      if (f.first_seen != nullptr) prefetch_bytes(f.first_seen, 0, kPybindBytes);
    }
  }

  void stage_shard(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      if (f.first_seen == nullptr) continue;
      f.first = py::reinterpret_borrow<py::object>(f.first_seen);
      prefetch_shard(f.first_seen);
    }
  }

  const py::list& values_;
  const IdSet& owned_;
  const py::handle& dtensor_;
  const int64_t n_;
  std::vector<ValueFacts> facts_;
};

}  // namespace

py::tuple load_dests(
    const py::list& values,
    const at::Tensor& rows,
    const at::Tensor& table,
    const at::Tensor& canon_rows,
    const IdSet& owned_ids,
    const py::handle& dtensor_type,
    const py::handle& shard_type,
    const py::handle& replicate_type,
    const py::function& mesh_facts,
    const py::function& nd_box,
    c10::Device device,
    int64_t rank,
    bool scalar_from_any_1dim,
    DestFeed* feed) {
  const auto n = static_cast<int64_t>(values.size());
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == n, "rows must be int64 [",
                    n, "], got ", rows.toString(), " of ", rows.numel());
  TORCH_CHECK_VALUE(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == kWidth,
                    "table must be int64 [R, ", kWidth, "], got ", table.toString());
  const int64_t R = table.size(0);
  TORCH_CHECK_VALUE(canon_rows.scalar_type() == at::kLong && canon_rows.numel() == R, "canon_rows must be int64 [",
                    R, "], got ", canon_rows.toString());
  const auto rows_c = rows.contiguous();
  const auto table_c = table.contiguous();
  const auto canon_c = canon_rows.contiguous();
  const int64_t* row_of = rows_c.data_ptr<int64_t>();
  const int64_t* tab = table_c.data_ptr<int64_t>();
  const int64_t* canon = canon_c.data_ptr<int64_t>();

  std::vector<at::Tensor> locals;
  std::vector<std::array<int64_t, 1 + kMaxDims>> meta;
  IdTable<size_t> dest_of(n);  // a value named by two keys: one destination
  std::vector<int64_t> unit_of_row(R, -1), unit_rows;
  if (feed == nullptr) locals.reserve(n);  // fed, the feed holds them
  meta.reserve(n);
  unit_rows.reserve(std::min(n, R));
  std::unordered_map<PyObject*, MeshFacts> facts_of;
  int64_t cast_keys = 0;
  py::list problems;
  auto problem = [&](int64_t i, const std::string& msg) { problems.append(py::make_tuple(i, msg)); };
  const std::string key = std::string("\"") + kKeyMark + "\"";

  FactsReader facts(values, owned_ids, dtensor_type);
  for (int64_t g = -FactsReader::kStages; g < facts.groups(); ++g) {
    facts.advance(g);
    if (g < 0) continue;
    const int64_t g0 = g * kGroup, g1 = std::min(n, g0 + kGroup);
    for (int64_t i = g0; i < g1; ++i) {
      PyObject* v = PyList_GET_ITEM(values.ptr(), i);
      const auto& vf = facts[i];
      struct Release {  // this value's objects let go while they are in the cache, however it ends
        FactsReader& r;
        int64_t i;
        ~Release() { r.release(i); }
      } release{facts, i};
      const int64_t j = row_of[i];
      TORCH_CHECK_VALUE(j >= 0 && j < R, "row ", j, " of value ", i, " is not in the table of ", R);
      const int64_t* row = tab + j * kWidth;
      const int64_t nd = row[1];
      if (!vf.owned) {
        problem(i, key + ": the model's state_dict() value is not one of its parameters or buffers (a state_dict "
                       "hook made a copy?), so it cannot be loaded in place.");
        continue;
      }
      const at::Tensor& t = THPVariable_Unpack(v);  // a DTensor: its global shape and dtype
      const auto sizes = t.sizes();
      // torch 0.3 saved scalars as 1-dim tensors of one element: load_state_dict copies such a value into
      // a 0-dim model tensor (_load_from_state_dict), and so does this, through a 1-dim view of it (the box
      // [0, 1) of the value).
      const bool scalar_of_1dim =
          !vf.dtensor && sizes.empty() && nd == 1 && (row[2] == 1 || (scalar_from_any_1dim && row[2] > 1));
      bool same_shape = scalar_of_1dim || static_cast<int64_t>(sizes.size()) == nd;
      for (int64_t d = 0; same_shape && !scalar_of_1dim && d < nd; ++d) same_shape = sizes[d] == row[2 + d];
      if (!same_shape) {
        std::ostringstream s;
        s << "size mismatch for " << kKeyMark << ": copying a param with shape torch.Size([";
        for (int64_t d = 0; d < nd; ++d) s << (d ? ", " : "") << row[2 + d];
        s << "]) from checkpoint, the shape in current model is torch.Size([";
        for (size_t d = 0; d < sizes.size(); ++d) s << (d ? ", " : "") << sizes[d];
        s << "]).";
        problem(i, s.str());
        continue;
      }
      const auto theirs = static_cast<c10::ScalarType>(row[0]);
      if (t.scalar_type() != theirs) {
        if (!castable(t.scalar_type()) || !castable(theirs)) {
          problem(i, key + ": the checkpoint holds " + c10::toString(theirs) + ", the model " +
                         c10::toString(t.scalar_type()) + "; only real dtypes and bool are cast, complex and float8 "
                         "must match.");
          continue;
        }
        ++cast_keys;
      }
      const int64_t c = canon[j];
      TORCH_CHECK_VALUE(c >= 0 && c < R, "canonical row ", c, " of row ", j, " is not in the table of ", R);
      if (unit_of_row[c] < 0) {
        unit_of_row[c] = static_cast<int64_t>(unit_rows.size());
        unit_rows.push_back(c);
      }

      // This rank's local tensor and the global offset of the box it holds.
      std::array<int64_t, 1 + kMaxDims> m{};
      m[0] = unit_of_row[c];
      // The tensor written, by pointer: a held copy costs its TensorImpl's refcount twice, ~13% of this pass
      // at 16k keys (perf, CPU machine). Every tensor pointed at is held by a Python object alive to the end of
      // this value's turn (the values list, or the DTensor's local tensor in vf.local).
      at::Tensor viewed;
      if (scalar_of_1dim) viewed = t.view({1});
      const at::Tensor* lp = scalar_of_1dim ? &viewed : &t;
      std::array<int64_t, kMaxDims> shape_buf{};
      std::copy(sizes.begin(), sizes.end(), shape_buf.begin());
      c10::IntArrayRef local_shape(shape_buf.data(), sizes.size());
      if (vf.dtensor) {
        const py::object& local_obj = vf.local;
        const py::object& mesh = vf.mesh;
        const py::object& placements = vf.placements;
        TORCH_CHECK_TYPE(THPVariable_Check(local_obj.ptr()), "the local tensor of value ", i, " is a ",
                         py_str(py::type::of(local_obj)));
        lp = &THPVariable_Unpack(local_obj.ptr());
        auto found = facts_of.find(mesh.ptr());
        if (found == facts_of.end()) {  // once per mesh: DeviceMesh's own calls cost microseconds each
          auto f = mesh_facts(mesh).cast<std::tuple<bool, int64_t, int64_t, int64_t>>();
          found = facts_of.emplace(mesh.ptr(), MeshFacts{std::get<0>(f), std::get<1>(f), std::get<2>(f),
                                                         std::get<3>(f)}).first;
        }
        const auto& f = found->second;
        if (f.ndim == 1 && f.member) {
          py::object p = vf.first ? vf.first : py::object(placements[py::int_(0)]);
          if (p.get_type().is(shard_type)) {  // torch.chunk's split, as DTensor's Shard: ceil-sized chunks, empty tails
            TORCH_CHECK_VALUE(nd > 0, "value ", i, " is a 0-dim DTensor placed ", py_str(p));
            const int64_t d = ((shard_dim(p) % nd) + nd) % nd;
            const int64_t len = row[2 + d];
            const int64_t chunk = (len + f.size - 1) / f.size;
            const int64_t lo = std::min(f.coord * chunk, len);
            m[1 + d] = lo;
            shape_buf[d] = std::min(lo + chunk, len) - lo;
          } else if (!p.get_type().is(replicate_type)) {
            problem(i, key + ": placement " + py_str(p) + " is not supported (only Shard(dim) and Replicate)");
            continue;
          }
        } else {
          py::tuple shape(nd);
          for (int64_t d = 0; d < nd; ++d) shape[d] = py::int_(row[2 + d]);
          auto box = nd_box(mesh, placements, shape).cast<py::tuple>();
          if (!box[0].is_none()) {
            problem(i, key + ": " + py_str(box[0]));
            continue;
          }
          if (box[1].is_none()) continue;  // this rank is not in the mesh: it holds nothing
          auto lo = box[1].cast<std::vector<int64_t>>();
          auto box_shape = box[2].cast<std::vector<int64_t>>();
          TORCH_CHECK_VALUE(lo.size() == static_cast<size_t>(nd) && box_shape.size() == static_cast<size_t>(nd),
                            "nd_box gave a box of ", lo.size(), " and ", box_shape.size(), " dims for value ", i,
                            " of ", nd);
          std::copy(lo.begin(), lo.end(), m.begin() + 1);
          std::copy(box_shape.begin(), box_shape.end(), shape_buf.begin());
        }
        // A box of no elements takes no bytes whatever its shape: FSDP2 gives a (1, 0) parameter's rank 0 a
        // (0, 0) shard where Shard(0) splits it as (1, 0).
        const bool empty_both = lp->numel() == 0 && c10::multiply_integers(local_shape) == 0;
        if (!lp->sizes().equals(local_shape) && !empty_both) {
          problem(i, key + ": rank " + std::to_string(rank) + " holds a local shard of shape " +
                         tuple_str(lp->sizes()) + ", but its placements " + py_str(placements) +
                         " on a mesh of shape " + py_str(py::tuple(mesh.attr("shape"))) + " give " +
                         tuple_str(local_shape));
          continue;
        }
      }
      const at::Tensor& local = *lp;
      // The model's device is its first tensor's (first_device): the others are checked here, as they are read.
      if (local.is_meta()) {
        problem(i, key + " is on the meta device: materialize the model first (model.to_empty(device=...))");
        continue;
      }
      // On a GPU, a destination in host memory (FSDP2's CPU offload) is written from there: pinned memory
      // by the GPU, pageable memory by the host out of a pinned copy of the bucket (load_plan.cpp).
      const bool host_dest = local.numel() > 0 && local.is_cpu() && device.is_cuda();
      if (local.numel() > 0 && local.device() != device && !host_dest) {
        std::ostringstream s;
        s << key << " is on " << local.device() << ", the model's first tensor on " << device
          << ": load_full_state_dict needs the model on one device";
        problem(i, s.str());
        continue;
      }
      auto [dest, fresh] = dest_of.find_or_add(reinterpret_cast<uintptr_t>(v), meta.size());
      if (fresh) {
        // Fed, the feed alone holds the tensor: a second reference per key cost its refcount's line twice
        // more (taken and, when the list was let go before the transfer, given back), beside the planning
        // thread reading that tensor. Where that plan is not used, the caller takes them from the feed.
        if (feed != nullptr) {
          feed->put(local, m);
        } else {
          locals.push_back(local);
        }
        meta.push_back(m);
      } else {
        meta[dest] = m;  // the last key's unit, in the first key's place
        if (feed != nullptr) feed->spoil();
      }
    }
  }

  auto meta_t = at::empty({static_cast<int64_t>(meta.size()), 1 + kMaxDims}, at::kLong);
  std::copy(reinterpret_cast<const int64_t*>(meta.data()),
            reinterpret_cast<const int64_t*>(meta.data()) + meta.size() * (1 + kMaxDims), meta_t.data_ptr<int64_t>());
  const auto U = static_cast<int64_t>(unit_rows.size());
  auto units_t = at::empty({U, kWidth}, at::kLong);
  auto src_rows = at::empty({U}, at::kLong);
  for (int64_t u = 0; u < U; ++u) {
    std::copy(tab + unit_rows[u] * kWidth, tab + (unit_rows[u] + 1) * kWidth, units_t.data_ptr<int64_t>() + u * kWidth);
    src_rows.data_ptr<int64_t>()[u] = unit_rows[u];
  }
  return py::make_tuple(py::cast(TensorList{std::move(locals)}), meta_t, units_t, src_rows, cast_keys, problems);
}

std::tuple<std::optional<c10::Device>, int64_t> first_device(const py::iterable& values,
                                                             const py::handle& dtensor_type) {
  int64_t i = 0;
  for (const auto v : values) {  // an iterable, read up to the first found: no list of every value made
    const int64_t index = i++;
    if (!THPVariable_Check(v.ptr())) continue;  // extra state, or anything else a state_dict hook put there
    const int is_dtensor = PyObject_IsInstance(v.ptr(), dtensor_type.ptr());
    if (is_dtensor < 0) throw py::error_already_set();
    py::object local = is_dtensor == 1 ? attr(v, "_local_tensor") : py::reinterpret_borrow<py::object>(v);
    if (!THPVariable_Check(local.ptr())) continue;
    const at::Tensor& t = THPVariable_Unpack(local.ptr());
    if (t.is_meta() || t.numel() > 0) return {t.device(), index};
  }
  return {std::nullopt, -1};
}

}  // namespace coalesced_bcast

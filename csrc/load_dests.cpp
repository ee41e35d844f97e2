// load dests: per kept state-dict value, the checks and the box arithmetic of
// a load's model side, as attribute reads and integer math here (a per-key
// pass in Python was most of a load's own host time at many keys). Python
// objects are read through public CPython calls only; torch's private
// attribute names come from the adapter (module_attrs.h).
#include "load_dests.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <sstream>
#include <unordered_map>

#include "cast.h"
#include "chunks.h"
#include "copy_table.h"
#include "module_attrs.h"
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

// Shard(d)'s d, by its public attribute.
int64_t shard_dim(const py::object& p) {
  return attr_or_raise(p.ptr(), torch_names().dim).cast<int64_t>();
}

// What a value's Python objects say, read in stages (below).
struct ValueFacts {
  bool tensor = false;   // a torch.Tensor (else extra state or a hook's object)
  bool owned = false;    // one of the model's own parameters or buffers
  bool dtensor = false;
  py::object local;      // a DTensor's: its local tensor, spec, mesh, placements, placements[0]
  py::object spec;
  py::object mesh;
  py::object placements;
  py::object first;
};

// Values are read kGroup at a time, each group's chain one hop per stage (below).
constexpr int64_t kGroup = 16;

// The facts of the values, read as a pipeline over groups of kGroup: each
// stage takes one hop of a group's chains (value -> local tensor and spec ->
// mesh and placements -> placements[0], and the TensorImpls), asking for the
// lines of what the next stage reads, and a group's next stage runs a whole
// group's work later, so that those lines have arrived: values made between
// other allocations are cold, and one chain at a time waits on memory at every
// hop. Each value's objects are let go right after it is used, while they are
// in the cache.
class FactsReader {
 public:
  static constexpr int kStages = 4;

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
        case 1: stage_dtensor(b, e); break;
        case 2: stage_spec(b, e); break;
        default: stage_first(b, e); break;
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
      prefetch_object(item(i));
      owned_.prefetch(reinterpret_cast<uintptr_t>(item(i)));
    }
  }

  void stage_dtensor(int64_t b, int64_t e) {
    const auto& nm = torch_names();
    for (int64_t i = b; i < e; ++i) {
      PyObject* v = item(i);
      auto& f = facts_[i];
      f.tensor = THPVariable_Check(v);
      if (!f.tensor) continue;
      prefetch_impl(THPVariable_Unpack(v).unsafeGetTensorImpl());  // its (global) shape
      f.owned = owned_.contains(reinterpret_cast<uintptr_t>(v));
      const int is_dtensor = PyObject_IsInstance(v, dtensor_.ptr());
      if (is_dtensor < 0) throw py::error_already_set();
      f.dtensor = is_dtensor == 1;
      if (!f.dtensor) continue;
      f.local = attr_or_raise(v, nm.local_tensor);
      f.spec = attr_or_raise(v, nm.spec);
      prefetch_object(f.local.ptr());
      prefetch_object(f.spec.ptr());
    }
  }

  void stage_spec(int64_t b, int64_t e) {
    const auto& nm = torch_names();
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      if (!f.spec) continue;
      if (THPVariable_Check(f.local.ptr())) prefetch_impl(THPVariable_Unpack(f.local.ptr()).unsafeGetTensorImpl());
      f.mesh = attr_or_raise(f.spec.ptr(), nm.spec_mesh);
      f.placements = attr_or_raise(f.spec.ptr(), nm.spec_placements);
      prefetch_object(f.placements.ptr());
    }
  }

  void stage_first(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      auto& f = facts_[i];
      PyObject* p = f.placements.ptr();
      if (p == nullptr || !PyTuple_Check(p) || PyTuple_GET_SIZE(p) == 0) continue;
      f.first = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(p, 0));
      prefetch_object(f.first.ptr());
    }
  }

  const py::list& values_;
  const IdSet& owned_;
  const py::handle& dtensor_;
  const int64_t n_;
  std::vector<ValueFacts> facts_;
};

// One load_dests call's state: what the values found so far give, and the
// per-value steps (take) that add to it.
class DestsBuilder {
 public:
  DestsBuilder(const at::Tensor& table, const at::Tensor& canon_rows, int64_t n, const py::handle& shard_type,
               const py::handle& replicate_type, const py::function& mesh_facts, const py::function& nd_box,
               c10::Device device, int64_t rank, bool scalar_from_any_1dim, DestFeed* feed)
      : table_(table.contiguous()), canon_(canon_rows.contiguous()), R_(table.size(0)),
        tab_(table_.data_ptr<int64_t>()), canon_rows_(canon_.data_ptr<int64_t>()), dest_of_(n), unit_of_row_(R_, -1),
        shard_type_(shard_type), replicate_type_(replicate_type), mesh_facts_(mesh_facts), nd_box_(nd_box),
        device_(device), rank_(rank), scalar_from_any_1dim_(scalar_from_any_1dim), feed_(feed) {
    if (feed == nullptr) locals_.reserve(n);  // fed, the feed holds them
    meta_.reserve(n);
    unit_rows_.reserve(std::min(n, R_));
  }

  // Value i (v, as vf read it) against table row j.
  void take(int64_t i, PyObject* v, const ValueFacts& vf, int64_t j);
  py::tuple result();

 private:
  using Meta = std::array<int64_t, 1 + kMaxDims>;
  void problem(int64_t i, const std::string& msg) { problems_.append(py::make_tuple(i, msg)); }
  bool same_shape(int64_t i, c10::IntArrayRef sizes, const int64_t* row, bool scalar_of_1dim);
  bool dtype_ok(int64_t i, c10::ScalarType ours, c10::ScalarType theirs);
  bool dtensor_box(int64_t i, const ValueFacts& vf, const int64_t* row, Meta& m, std::array<int64_t, kMaxDims>& shape,
                   size_t ndim, const at::Tensor*& lp);
  const MeshFacts& facts_of(const py::object& mesh);
  bool placed(int64_t i, const MeshFacts& f, const ValueFacts& vf, const int64_t* row, Meta& m,
              std::array<int64_t, kMaxDims>& shape);
  bool device_ok(int64_t i, const at::Tensor& local);
  void add(PyObject* v, const at::Tensor& local, const Meta& m);

  const at::Tensor table_, canon_;
  const int64_t R_;
  const int64_t* tab_;
  const int64_t* canon_rows_;
  std::vector<at::Tensor> locals_;
  std::vector<Meta> meta_;
  IdTable<size_t> dest_of_;  // a value named by two keys: one destination
  std::vector<int64_t> unit_of_row_, unit_rows_;
  std::unordered_map<PyObject*, MeshFacts> mesh_facts_of_;
  int64_t cast_keys_ = 0;
  py::list problems_;
  const std::string key_ = std::string("\"") + kKeyMark + "\"";
  const py::handle& shard_type_;
  const py::handle& replicate_type_;
  const py::function& mesh_facts_;
  const py::function& nd_box_;
  const c10::Device device_;
  const int64_t rank_;
  const bool scalar_from_any_1dim_;
  DestFeed* const feed_;
};

bool DestsBuilder::same_shape(int64_t i, c10::IntArrayRef sizes, const int64_t* row, bool scalar_of_1dim) {
  const int64_t nd = row[1];
  bool same = scalar_of_1dim || static_cast<int64_t>(sizes.size()) == nd;
  for (int64_t d = 0; same && !scalar_of_1dim && d < nd; ++d) same = sizes[d] == row[2 + d];
  if (same) return true;
  std::ostringstream s;
  s << "size mismatch for " << kKeyMark << ": copying a param with shape torch.Size([";
  for (int64_t d = 0; d < nd; ++d) s << (d ? ", " : "") << row[2 + d];
  s << "]) from checkpoint, the shape in current model is torch.Size([";
  for (size_t d = 0; d < sizes.size(); ++d) s << (d ? ", " : "") << sizes[d];
  s << "]).";
  problem(i, s.str());
  return false;
}

bool DestsBuilder::dtype_ok(int64_t i, c10::ScalarType ours, c10::ScalarType theirs) {
  if (ours == theirs) return true;
  if (!castable(ours) || !castable(theirs)) {
    problem(i, key_ + ": the checkpoint holds " + c10::toString(theirs) + ", the model " + c10::toString(ours) +
                   "; only real dtypes and bool are cast, complex and float8 must match.");
    return false;
  }
  ++cast_keys_;
  return true;
}

void DestsBuilder::take(int64_t i, PyObject* v, const ValueFacts& vf, int64_t j) {
  TORCH_CHECK_VALUE(j >= 0 && j < R_, "row ", j, " of value ", i, " is not in the table of ", R_);
  const int64_t* row = tab_ + j * kWidth;
  const int64_t nd = row[1];
  if (!vf.owned) {
    problem(i, key_ + ": the model's state_dict() value is not one of its parameters or buffers (a state_dict "
                      "hook made a copy?), so it cannot be loaded in place.");
    return;
  }
  const at::Tensor& t = THPVariable_Unpack(v);  // a DTensor: its global shape and dtype
  const auto sizes = t.sizes();
  // torch 0.3 saved scalars as 1-dim tensors of one element: load_state_dict copies such a value into
  // a 0-dim model tensor (_load_from_state_dict), and so does this, through a 1-dim view of it (the box
  // [0, 1) of the value).
  const bool scalar_of_1dim =
      !vf.dtensor && sizes.empty() && nd == 1 && (row[2] == 1 || (scalar_from_any_1dim_ && row[2] > 1));
  if (!same_shape(i, sizes, row, scalar_of_1dim)) return;
  if (!dtype_ok(i, t.scalar_type(), static_cast<c10::ScalarType>(row[0]))) return;
  const int64_t c = canon_rows_[j];
  TORCH_CHECK_VALUE(c >= 0 && c < R_, "canonical row ", c, " of row ", j, " is not in the table of ", R_);
  if (unit_of_row_[c] < 0) {
    unit_of_row_[c] = static_cast<int64_t>(unit_rows_.size());
    unit_rows_.push_back(c);
  }
  // This rank's local tensor and the global offset of the box it holds.
  Meta m{};
  m[0] = unit_of_row_[c];
  // The tensor written, by pointer: a held copy would cost its TensorImpl's refcount twice per key. Every
  // tensor pointed at is held by a Python object alive to the end of this value's turn (the values list,
  // or the DTensor's local tensor in vf.local).
  at::Tensor viewed;
  if (scalar_of_1dim) viewed = t.view({1});
  const at::Tensor* lp = scalar_of_1dim ? &viewed : &t;
  std::array<int64_t, kMaxDims> shape_buf{};
  std::copy(sizes.begin(), sizes.end(), shape_buf.begin());
  if (vf.dtensor && !dtensor_box(i, vf, row, m, shape_buf, sizes.size(), lp)) return;
  if (!device_ok(i, *lp)) return;
  add(v, *lp, m);
}

const MeshFacts& DestsBuilder::facts_of(const py::object& mesh) {
  auto found = mesh_facts_of_.find(mesh.ptr());
  if (found == mesh_facts_of_.end()) {  // once per mesh: DeviceMesh's own calls cost microseconds each
    auto f = mesh_facts_(mesh).cast<std::tuple<bool, int64_t, int64_t, int64_t>>();
    found = mesh_facts_of_.emplace(mesh.ptr(), MeshFacts{std::get<0>(f), std::get<1>(f), std::get<2>(f),
                                                         std::get<3>(f)}).first;
  }
  return found->second;
}

// A DTensor value's box on this rank: its offset into m, its shape into `shape`, its local tensor into lp.
bool DestsBuilder::dtensor_box(int64_t i, const ValueFacts& vf, const int64_t* row, Meta& m,
                               std::array<int64_t, kMaxDims>& shape, size_t ndim, const at::Tensor*& lp) {
  TORCH_CHECK_TYPE(THPVariable_Check(vf.local.ptr()), "the local tensor of value ", i, " is a ",
                   py_str(py::type::of(vf.local)));
  lp = &THPVariable_Unpack(vf.local.ptr());
  const auto& f = facts_of(vf.mesh);
  if (!placed(i, f, vf, row, m, shape)) return false;
  // A box of no elements takes no bytes whatever its shape: FSDP2 gives a (1, 0) parameter's rank 0 a
  // (0, 0) shard where Shard(0) splits it as (1, 0).
  const c10::IntArrayRef local_shape(shape.data(), ndim);
  const bool empty_both = lp->numel() == 0 && c10::multiply_integers(local_shape) == 0;
  if (lp->sizes().equals(local_shape) || empty_both) return true;
  const py::object mesh_shape = attr_or_raise(vf.mesh.ptr(), torch_names().shape);
  problem(i, key_ + ": rank " + std::to_string(rank_) + " holds a local shard of shape " + tuple_str(lp->sizes()) +
                 ", but its placements " + py_str(vf.placements) + " on a mesh of shape " +
                 py_str(py::tuple(mesh_shape)) + " give " + tuple_str(local_shape));
  return false;
}

// The box of a value placed on its mesh: 1-D meshes here, others by nd_box. False where a problem is
// recorded or this rank holds nothing.
bool DestsBuilder::placed(int64_t i, const MeshFacts& f, const ValueFacts& vf, const int64_t* row, Meta& m,
                          std::array<int64_t, kMaxDims>& shape) {
  const int64_t nd = row[1];
  if (f.ndim == 1 && f.member) {
    py::object p = vf.first ? vf.first : py::object(vf.placements[py::int_(0)]);
    if (p.get_type().is(shard_type_)) {  // torch.chunk's split, as DTensor's Shard: ceil-sized chunks, empty tails
      TORCH_CHECK_VALUE(nd > 0, "value ", i, " is a 0-dim DTensor placed ", py_str(p));
      const int64_t d = ((shard_dim(p) % nd) + nd) % nd;
      const int64_t len = row[2 + d];
      const int64_t chunk = (len + f.size - 1) / f.size;
      const int64_t lo = std::min(f.coord * chunk, len);
      m[1 + d] = lo;
      shape[d] = std::min(lo + chunk, len) - lo;
    } else if (!p.get_type().is(replicate_type_)) {
      problem(i, key_ + ": placement " + py_str(p) + " is not supported (only Shard(dim) and Replicate)");
      return false;
    }
    return true;
  }
  py::tuple global(nd);
  for (int64_t d = 0; d < nd; ++d) global[d] = py::int_(row[2 + d]);
  auto box = nd_box_(vf.mesh, vf.placements, global).cast<py::tuple>();
  if (!box[0].is_none()) {
    problem(i, key_ + ": " + py_str(box[0]));
    return false;
  }
  if (box[1].is_none()) return false;  // this rank is not in the mesh: it holds nothing
  auto lo = box[1].cast<std::vector<int64_t>>();
  auto box_shape = box[2].cast<std::vector<int64_t>>();
  TORCH_CHECK_VALUE(lo.size() == static_cast<size_t>(nd) && box_shape.size() == static_cast<size_t>(nd),
                    "nd_box gave a box of ", lo.size(), " and ", box_shape.size(), " dims for value ", i, " of ", nd);
  std::copy(lo.begin(), lo.end(), m.begin() + 1);
  std::copy(box_shape.begin(), box_shape.end(), shape.begin());
  return true;
}

// The model's device is its first tensor's (first_device): the others are checked here, as they are read.
bool DestsBuilder::device_ok(int64_t i, const at::Tensor& local) {
  if (local.is_meta()) {
    problem(i, key_ + " is on the meta device: materialize the model first (model.to_empty(device=...))");
    return false;
  }
  // On a GPU, a destination in host memory (FSDP2's CPU offload) is written from there: pinned memory
  // by the GPU, pageable memory by the host out of a pinned copy of the bucket (load_plan.cpp).
  const bool host_dest = local.numel() > 0 && local.is_cpu() && device_.is_cuda();
  if (local.numel() == 0 || local.device() == device_ || host_dest) return true;
  std::ostringstream s;
  s << key_ << " is on " << local.device() << ", the model's first tensor on " << device_
    << ": load_full_state_dict needs the model on one device";
  problem(i, s.str());
  return false;
}

void DestsBuilder::add(PyObject* v, const at::Tensor& local, const Meta& m) {
  auto [dest, fresh] = dest_of_.find_or_add(reinterpret_cast<uintptr_t>(v), meta_.size());
  if (!fresh) {
    meta_[dest] = m;  // the last key's unit, in the first key's place
    if (feed_ != nullptr) feed_->spoil();
    return;
  }
  // Fed, the feed alone holds the tensor: a second reference per key would touch its refcount twice more
  // (taken and, when the list is let go before the transfer, given back), beside the planning thread
  // reading that tensor. Where that plan is not used, the caller takes them from the feed.
  if (feed_ != nullptr) {
    feed_->put(local, m);
  } else {
    locals_.push_back(local);
  }
  meta_.push_back(m);
}

py::tuple DestsBuilder::result() {
  auto meta_t = at::empty({static_cast<int64_t>(meta_.size()), 1 + kMaxDims}, at::kLong);
  std::copy(reinterpret_cast<const int64_t*>(meta_.data()),
            reinterpret_cast<const int64_t*>(meta_.data()) + meta_.size() * (1 + kMaxDims), meta_t.data_ptr<int64_t>());
  const auto U = static_cast<int64_t>(unit_rows_.size());
  auto units_t = at::empty({U, kWidth}, at::kLong);
  auto src_rows = at::empty({U}, at::kLong);
  for (int64_t u = 0; u < U; ++u) {
    std::copy(tab_ + unit_rows_[u] * kWidth, tab_ + (unit_rows_[u] + 1) * kWidth,
              units_t.data_ptr<int64_t>() + u * kWidth);
    src_rows.data_ptr<int64_t>()[u] = unit_rows_[u];
  }
  return py::make_tuple(py::cast(TensorList{std::move(locals_)}), meta_t, units_t, src_rows, cast_keys_, problems_);
}

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
  TORCH_CHECK_VALUE(canon_rows.scalar_type() == at::kLong && canon_rows.numel() == table.size(0),
                    "canon_rows must be int64 [", table.size(0), "], got ", canon_rows.toString());
  const auto rows_c = rows.contiguous();
  const int64_t* row_of = rows_c.data_ptr<int64_t>();
  DestsBuilder out(table, canon_rows, n, shard_type, replicate_type, mesh_facts, nd_box, device, rank,
                   scalar_from_any_1dim, feed);
  FactsReader facts(values, owned_ids, dtensor_type);
  for (int64_t g = -FactsReader::kStages; g < facts.groups(); ++g) {
    facts.advance(g);
    if (g < 0) continue;
    for (int64_t i = g * kGroup; i < std::min(n, (g + 1) * kGroup); ++i) {
      struct Release {  // this value's objects let go while they are in the cache, however it ends
        FactsReader& r;
        int64_t i;
        ~Release() { r.release(i); }
      } release{facts, i};
      out.take(i, PyList_GET_ITEM(values.ptr(), i), facts[i], row_of[i]);
    }
  }
  return out.result();
}

std::tuple<std::optional<c10::Device>, int64_t> first_device(const py::iterable& values,
                                                             const py::handle& dtensor_type) {
  int64_t i = 0;
  for (const auto v : values) {  // an iterable, read up to the first found: no list of every value made
    const int64_t index = i++;
    if (!THPVariable_Check(v.ptr())) continue;  // extra state, or anything else a state_dict hook put there
    const int is_dtensor = PyObject_IsInstance(v.ptr(), dtensor_type.ptr());
    if (is_dtensor < 0) throw py::error_already_set();
    py::object local = is_dtensor == 1 ? attr_or_raise(v.ptr(), torch_names().local_tensor)
                                       : py::reinterpret_borrow<py::object>(v);
    if (!THPVariable_Check(local.ptr())) continue;
    const at::Tensor& t = THPVariable_Unpack(local.ptr());
    if (t.is_meta() || t.numel() > 0) return {t.device(), index};
  }
  return {std::nullopt, -1};
}

}  // namespace coalesced_bcast

// FSDP2 registers a post-hook per parameter, so a large model has as many
// hooks as parameters; judged here in one pass, not in Python. The rules are
// those of idle_fsdp_hook in post_hooks.h; FSDP2's attribute names come from
// the adapter (module_attrs.h).
#include "post_hooks.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "chunks.h"
#include "host_memory.h"
#include "module_attrs.h"

namespace coalesced_bcast {
namespace {

bool ends_with(PyObject* str, const std::string& tail) {
  if (str == nullptr || !PyUnicode_Check(str)) return false;
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(str, &len);
  if (s == nullptr) {
    PyErr_Clear();
    return false;
  }
  const auto n = static_cast<Py_ssize_t>(tail.size());
  return len >= n && std::memcmp(s + len - n, tail.data(), n) == 0;
}

// What one of FSDP2's hooks reads: hook -> closure -> cell -> FSDPParam -> its
// parameter (a DTensor), padded storage, module info and pin flag -> the
// module, the parameter's name and the DTensor's local shard. Fetched hop by
// hop for a group of hooks at once (all_judged_idle), each object read once.
struct Chain {
  PyObject* fp = nullptr;  // the FSDPParam, borrowed from the hook's closure cell
  py::object param, data, info, pin, owner, pname, local;
};

// Whether m's hook, fetched as c, is idle (the rules of idle_fsdp_hook).
// params: m's parameters dict (borrowed; may be null).
bool idle(PyObject* m, PyObject* params, PyObject* hook, const Chain& c) {
  if (!ends_with(PyFunction_GET_MODULE(hook), torch_names().fsdp_param_module_suffix)) return false;
  if (c.owner.ptr() != m || params == nullptr || !PyDict_Check(params)) return false;
  PyObject* held = PyDict_GetItemWithError(params, c.pname.ptr());  // borrowed
  if (held == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (held != c.param.ptr()) return false;
  // type(data) is torch.Tensor: FSDP2's padded storage, a plain tensor
  if (Py_TYPE(c.data.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
      !THPVariable_Check(c.local.ptr())) {
    return false;
  }
  const int pinned = PyObject_IsTrue(c.pin.ptr());
  if (pinned < 0) {
    PyErr_Clear();
    return false;
  }
  try {
    const at::Tensor& shard = THPVariable_Unpack(c.local.ptr());
    const at::Tensor& padded = THPVariable_Unpack(c.data.ptr());
    // The shard starts the padded storage: one StorageImpl, one first byte, read
    // from the two TensorImpls (their data pointers would touch each StorageImpl
    // too, a cold line more per hook). An empty or meta shard is not judged idle.
    if (!shard.has_storage() || !padded.has_storage() || shard.is_meta() || shard.numel() == 0) return false;
    if (shard.storage().unsafeGetStorageImpl() != padded.storage().unsafeGetStorageImpl() ||
        shard.storage_offset() * static_cast<int64_t>(shard.dtype().itemsize()) !=
            padded.storage_offset() * static_cast<int64_t>(padded.dtype().itemsize())) {
      return false;
    }
    return !(pinned && !pinned_host(shard));  // where FSDP2 pins, its shard is torch's pinned memory
  } catch (const std::exception&) {  // a tensor this build cannot read so (symbolic sizes, no data)
    return false;
  }
}

// load_state_dict's walk: children first, then the module's own hooks; a
// module reached twice is visited twice, as there. False where a module cannot
// be read as one. A module's hooks are read from its dict of them directly,
// also where that is an OrderedDict (torch's): the verdict is over all of them,
// whatever their order, and an OrderedDict's iterator looks each key up twice.
bool collect(PyObject* m, std::vector<std::pair<PyObject*, py::object>>& out) {
  const auto& a = torch_names();
  py::object children = attr_or_empty(m, a.modules), hooks = attr_or_empty(m, a.load_post_hooks);
  if (!children || !PyDict_Check(children.ptr()) || !hooks || !PyDict_Check(hooks.ptr())) return false;
  const auto child_hooks = [&](PyObject*, PyObject* child) { return child == Py_None || collect(child, out); };
  if (!for_items(children.ptr(), child_hooks)) return false;
  const auto add = [&](PyObject*, PyObject* hook) {
    out.emplace_back(m, py::reinterpret_borrow<py::object>(hook));
    return true;
  };
  if (!PyDict_CheckExact(hooks.ptr()) && !PyODict_CheckExact(hooks.ptr())) return for_items(hooks.ptr(), add);
  Py_ssize_t pos = 0;
  PyObject *key = nullptr, *hook = nullptr;
  while (PyDict_Next(hooks.ptr(), &pos, &key, &hook)) add(key, hook);
  return true;
}

constexpr size_t kGroup = 16;

// The hooks judged kGroup at a time, one hop of the chain per pass over the
// group, each pass prefetching what the next reads, so that a group's cache
// misses overlap: after a large load the FSDPParams, DTensors and tensors are
// cold, and one chain at a time would wait on memory at every hop. Hooks
// [begin, end).
bool all_judged_idle(const std::vector<std::pair<PyObject*, py::object>>& hooks, size_t begin, size_t end) {
  const auto& nm = torch_names();
  PyObject* last_module = nullptr;
  py::object params;  // last_module's parameters dict: a module's hooks are consecutive
  Chain c[kGroup];
  PyObject* obj[kGroup];
  for (size_t g0 = begin; g0 < end; g0 += kGroup) {
    const size_t g = std::min(kGroup, end - g0);
    for (size_t b = 0; b < g; ++b) prefetch_object(obj[b] = hooks[g0 + b].second.ptr());
    for (size_t b = 0; b < g; ++b) {  // hooks -> closures
      if (!PyFunction_Check(obj[b])) return false;
      PyObject* closure = PyFunction_GET_CLOSURE(obj[b]);
      if (closure == nullptr || !PyTuple_Check(closure) || PyTuple_GET_SIZE(closure) == 0) return false;
      __builtin_prefetch(obj[b] = closure);
    }
    for (size_t b = 0; b < g; ++b) __builtin_prefetch(obj[b] = PyTuple_GET_ITEM(obj[b], 0));  // -> cells
    for (size_t b = 0; b < g; ++b) {  // -> FSDPParams
      PyObject* fp = PyCell_Check(obj[b]) ? PyCell_GET(obj[b]) : nullptr;
      if (fp == nullptr || nm.fsdp_param_type != Py_TYPE(fp)->tp_name) return false;
      prefetch_object(c[b].fp = fp);
    }
    for (size_t b = 0; b < g; ++b) {  // -> their parameters, padded storage, module info and pin flag
      c[b].param = attr_or_empty(c[b].fp, nm.fsdp_sharded_param);
      c[b].data = attr_or_empty(c[b].fp, nm.fsdp_sharded_param_data);
      c[b].info = attr_or_empty(c[b].fp, nm.fsdp_module_info);
      c[b].pin = attr_or_empty(c[b].fp, nm.fsdp_pin_memory);
      if (!c[b].param || !c[b].data || !c[b].info || !c[b].pin) return false;
      prefetch_object(c[b].param.ptr());
      prefetch_object(c[b].data.ptr());
      prefetch_object(c[b].info.ptr());
    }
    for (size_t b = 0; b < g; ++b) {  // -> the module, the parameter's name, the TensorImpls
      c[b].owner = attr_or_empty(c[b].info.ptr(), nm.fsdp_info_module);
      c[b].pname = attr_or_empty(c[b].info.ptr(), nm.fsdp_info_param_name);
      c[b].local = attr_or_empty(c[b].param.ptr(), nm.local_tensor);
      if (!c[b].owner || !c[b].pname || !c[b].local) return false;
      __builtin_prefetch(c[b].pname.ptr());  // its hash, for the module's _parameters
      if (THPVariable_Check(c[b].data.ptr())) prefetch_impl(THPVariable_Unpack(c[b].data.ptr()).unsafeGetTensorImpl());
      if (THPVariable_Check(c[b].local.ptr())) prefetch_impl(THPVariable_Unpack(c[b].local.ptr()).unsafeGetTensorImpl());
    }
    for (size_t b = 0; b < g; ++b) {
      PyObject* m = hooks[g0 + b].first;
      if (m != last_module) {
        params = attr_or_empty(m, nm.parameters);
        last_module = m;
      }
      if (!idle(m, params.ptr(), hooks[g0 + b].second.ptr(), c[b])) return false;
    }
  }
  return true;
}

}  // namespace

bool idle_fsdp_hook(const py::handle& module, const py::handle& hook) {
  const std::vector<std::pair<PyObject*, py::object>> one{{module.ptr(), py::reinterpret_borrow<py::object>(hook)}};
  return all_judged_idle(one, 0, 1);
}

HookJudgment::HookJudgment(const py::handle& model) {
  if (!collect(model.ptr(), hooks_)) verdict_ = false;
}

std::optional<bool> HookJudgment::step(int64_t count) {
  if (verdict_) return verdict_;
  const size_t end = std::min(hooks_.size(), next_ + static_cast<size_t>(std::max<int64_t>(count, 1)));
  if (!all_judged_idle(hooks_, next_, end)) {
    verdict_ = false;
  } else if ((next_ = end) == hooks_.size()) {
    verdict_ = true;
  }
  if (verdict_) hooks_.clear();  // the hooks' references: let them go once judged
  return verdict_;
}

bool HookJudgment::verdict() {
  return *step(static_cast<int64_t>(hooks_.size()));
}

bool post_hooks_idle(const py::handle& model) {
  return HookJudgment(model).verdict();
}

}  // namespace coalesced_bcast

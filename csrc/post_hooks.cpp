// FSDP2 registers a post-hook per parameter: at 16k parameters, judged in
// Python, ~2.4 us each (40 ms of a 150 ms load on one H200). The rules are
// those of idle_fsdp_hook in post_hooks.h.
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

// FSDP2's attribute names, interned once (a name made per read costs its hashing).
struct FsdpNames {
  PyObject* module_info = PyUnicode_InternFromString("_module_info");
  PyObject* sharded_param = PyUnicode_InternFromString("sharded_param");
  PyObject* module = PyUnicode_InternFromString("module");
  PyObject* param_name = PyUnicode_InternFromString("param_name");
  PyObject* param_data = PyUnicode_InternFromString("_sharded_param_data");
  PyObject* local_tensor = PyUnicode_InternFromString("_local_tensor");
  PyObject* pin_memory = PyUnicode_InternFromString("pin_memory");
};

const FsdpNames& names() {
  static const FsdpNames n;  // made under the GIL, on first use
  return n;
}

bool ends_with(PyObject* str, const char* tail) {
  if (str == nullptr || !PyUnicode_Check(str)) return false;
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(str, &len);
  if (s == nullptr) {
    PyErr_Clear();
    return false;
  }
  const auto n = static_cast<Py_ssize_t>(std::strlen(tail));
  return len >= n && std::memcmp(s + len - n, tail, n) == 0;
}

// The FSDPParam that a hook of FSDP2's closes over, or null.
PyObject* fsdp_param_of(PyObject* hook) {
  if (!PyFunction_Check(hook)) return nullptr;
  if (!ends_with(PyFunction_GET_MODULE(hook), "._fsdp_param")) return nullptr;
  PyObject* closure = PyFunction_GET_CLOSURE(hook);
  if (closure == nullptr || !PyTuple_Check(closure) || PyTuple_GET_SIZE(closure) == 0) return nullptr;
  PyObject* cell = PyTuple_GET_ITEM(closure, 0);
  if (!PyCell_Check(cell)) return nullptr;
  PyObject* fp = PyCell_GET(cell);
  if (fp == nullptr || std::strcmp(Py_TYPE(fp)->tp_name, "FSDPParam") != 0) return nullptr;
  return fp;
}

bool judge(PyObject* m, PyObject* hook) {
  PyObject* fp = fsdp_param_of(hook);
  if (fp == nullptr) return false;
  const auto& n = names();
  py::object info = attr_or_empty(fp, n.module_info), param = attr_or_empty(fp, n.sharded_param);
  if (!info || !param) return false;
  py::object owner = attr_or_empty(info.ptr(), n.module);
  if (!owner || owner.ptr() != m) return false;
  py::object pname = attr_or_empty(info.ptr(), n.param_name), params = attr_or_empty(m, module_attrs().parameters);
  if (!pname || !params || !PyDict_Check(params.ptr())) return false;
  PyObject* held = PyDict_GetItemWithError(params.ptr(), pname.ptr());  // borrowed
  if (held == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (held != param.ptr()) return false;
  py::object data = attr_or_empty(fp, n.param_data), local = attr_or_empty(param.ptr(), n.local_tensor);
  // type(data) is torch.Tensor: FSDP2's padded storage, a plain tensor
  if (!data || !local || Py_TYPE(data.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
      !THPVariable_Check(local.ptr())) {
    return false;
  }
  try {
    const at::Tensor& shard = THPVariable_Unpack(local.ptr());
    const at::Tensor& padded = THPVariable_Unpack(data.ptr());
    if (!shard.has_storage() || !padded.has_storage()) return false;
    const void* ptr = shard.const_data_ptr();
    if (ptr == nullptr || ptr != padded.const_data_ptr()) return false;
    py::object pin = attr_or_empty(fp, n.pin_memory);
    if (!pin) return false;
    const int pinned = PyObject_IsTrue(pin.ptr());
    if (pinned < 0) {
      PyErr_Clear();
      return false;
    }
    return !(pinned && !pinned_host(shard));  // where FSDP2 pins, its shard is torch's pinned memory
  } catch (const std::exception&) {  // a tensor without data this build can read
    return false;
  }
}

// load_state_dict's walk: children first, then the module's own hooks; a
// module reached twice is visited twice, as there. False where a module cannot
// be read as one.
bool collect(PyObject* m, std::vector<std::pair<PyObject*, py::object>>& out) {
  const auto& a = module_attrs();
  py::object children = attr_or_empty(m, a.modules), hooks = attr_or_empty(m, a.load_post_hooks);
  if (!children || !PyDict_Check(children.ptr()) || !hooks || !PyDict_Check(hooks.ptr())) return false;
  const auto child_hooks = [&](PyObject*, PyObject* child) { return child == Py_None || collect(child, out); };
  return for_items(children.ptr(), child_hooks) && for_items(hooks.ptr(), [&](PyObject*, PyObject* hook) {
           out.emplace_back(m, py::reinterpret_borrow<py::object>(hook));
           return true;
         });
}

constexpr size_t kGroup = 16;

// The hooks judged kGroup at a time, one hop of judge()'s chain per pass over
// the group (hook -> closure -> cell -> FSDPParam -> its parameter, padded
// storage and module info -> the tensors and the parameter's name), each pass
// prefetching what the next reads, so that a group's cache misses overlap:
// after a load of 16k parameters their FSDPParams, DTensors and tensors are
// cold, and one chain at a time waits on memory at every hop (on the CPU
// machine 1.6 us a hook that way, 0.9 us so). Then judge() itself, over
// objects now in cache.
// Hooks [begin, end).
bool all_judged_idle(const std::vector<std::pair<PyObject*, py::object>>& hooks, size_t begin, size_t end) {
  const auto& nm = names();
  for (size_t g0 = begin; g0 < end; g0 += kGroup) {
    const size_t g = std::min(kGroup, end - g0);
    PyObject* obj[kGroup];
    py::object param[kGroup], data[kGroup], info[kGroup];
    for (size_t b = 0; b < g; ++b) prefetch_object(obj[b] = hooks[g0 + b].second.ptr());
    for (size_t b = 0; b < g; ++b) {  // hooks -> closures
      if (!PyFunction_Check(obj[b])) return false;
      PyObject* closure = PyFunction_GET_CLOSURE(obj[b]);
      if (closure == nullptr || !PyTuple_Check(closure) || PyTuple_GET_SIZE(closure) == 0) return false;
      __builtin_prefetch(obj[b] = closure);
    }
    for (size_t b = 0; b < g; ++b) __builtin_prefetch(obj[b] = PyTuple_GET_ITEM(obj[b], 0));  // -> cells
    for (size_t b = 0; b < g; ++b) {  // -> FSDPParams
      obj[b] = PyCell_Check(obj[b]) ? PyCell_GET(obj[b]) : nullptr;
      if (obj[b] == nullptr) return false;
      prefetch_object(obj[b]);
    }
    for (size_t b = 0; b < g; ++b) {  // -> their parameters, padded storage and module info
      param[b] = attr_or_empty(obj[b], nm.sharded_param);
      data[b] = attr_or_empty(obj[b], nm.param_data);
      info[b] = attr_or_empty(obj[b], nm.module_info);
      if (!param[b] || !data[b] || !info[b]) return false;
      prefetch_object(param[b].ptr());
      prefetch_object(data[b].ptr());
      prefetch_object(info[b].ptr());
    }
    for (size_t b = 0; b < g; ++b) {  // -> the TensorImpls and parameter names
      py::object name = attr_or_empty(info[b].ptr(), nm.param_name);
      if (name) __builtin_prefetch(name.ptr());  // its hash, for the module's _parameters
      if (THPVariable_Check(data[b].ptr())) prefetch_impl(THPVariable_Unpack(data[b].ptr()).unsafeGetTensorImpl());
      py::object local = attr_or_empty(param[b].ptr(), nm.local_tensor);
      if (!local || !THPVariable_Check(local.ptr())) return false;
      prefetch_impl(THPVariable_Unpack(local.ptr()).unsafeGetTensorImpl());
    }
    for (size_t b = 0; b < g; ++b) {
      if (!judge(hooks[g0 + b].first, hooks[g0 + b].second.ptr())) return false;
    }
  }
  return true;
}

}  // namespace

bool idle_fsdp_hook(const py::handle& module, const py::handle& hook) {
  return judge(module.ptr(), hook.ptr());
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

#include "module_attrs.h"

#include <utility>

namespace coalesced_bcast {
namespace {

// Never destroyed: a static's destructor would run after the interpreter is gone.
TorchNames& names_slot() {
  static auto& n = *new TorchNames();
  return n;
}

bool names_set = false;

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// The adapter's name for `role`.
std::string names_role(const py::dict& names, const char* role) {
  TORCH_CHECK_VALUE(names.contains(role), "set_attribute_names: no name for '", role,
                    "' (coalesced_bcast._torch_internals.CPP_NAMES)");
  return py::str(names[role]).cast<std::string>();
}

PyObject* intern_role(const py::dict& names, const char* role) {
  return intern(names_role(names, role).c_str());
}

}  // namespace

void set_torch_names(const py::dict& names) {
  TorchNames n;
  n.modules = intern_role(names, "modules");
  n.parameters = intern_role(names, "parameters");
  n.buffers = intern_role(names, "buffers");
  n.load_pre_hooks = intern_role(names, "load_pre_hooks");
  n.load_post_hooks = intern_role(names, "load_post_hooks");
  n.load_from_state_dict = intern_role(names, "load_from_state_dict");
  n.local_tensor = intern_role(names, "local_tensor");
  n.spec = intern_role(names, "spec");
  n.spec_mesh = intern_role(names, "spec_mesh");
  n.spec_placements = intern_role(names, "spec_placements");
  n.fsdp_sharded_param = intern_role(names, "fsdp_sharded_param");
  n.fsdp_sharded_param_data = intern_role(names, "fsdp_sharded_param_data");
  n.fsdp_module_info = intern_role(names, "fsdp_module_info");
  n.fsdp_pin_memory = intern_role(names, "fsdp_pin_memory");
  n.fsdp_info_module = intern_role(names, "fsdp_info_module");
  n.fsdp_info_param_name = intern_role(names, "fsdp_info_param_name");
  n.fsdp_param_type = names_role(names, "fsdp_param_type");
  n.fsdp_param_module_suffix = names_role(names, "fsdp_param_module_suffix");
  n.get_extra_state = intern("get_extra_state");
  n.module_name = intern("__module__");
  n.dim = intern("dim");
  n.shape = intern("shape");
  names_slot() = std::move(n);  // the names replaced stay alive (interned, never let go)
  names_set = true;
}

const TorchNames& torch_names() {
  if (!names_set) {
    // The adapter's import calls set_attribute_names.
    py::module_::import("coalesced_bcast._torch_internals");
    TORCH_CHECK(names_set, "coalesced_bcast._torch_internals did not hand its attribute names to _C");
  }
  return names_slot();
}

py::object attr_or_empty(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

py::object attr_or_raise(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

py::object dict_attr(PyObject* m, PyObject* own, PyObject* name, bool mappings) {
  PyObject* v = own != nullptr ? PyDict_GetItemWithError(own, name) : nullptr;  // borrowed
  if (v != nullptr) {
    Py_INCREF(v);
  } else {
    PyErr_Clear();
    v = PyObject_GetAttr(m, name);
    if (v == nullptr) PyErr_Clear();
  }
  if (v != nullptr && !PyDict_Check(v) && !(mappings && PyObject_HasAttrString(v, "items"))) Py_CLEAR(v);
  return py::reinterpret_steal<py::object>(v);
}

}  // namespace coalesced_bcast

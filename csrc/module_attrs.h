// module_attrs: reading torch's Python objects (nn.Module, DTensor, FSDP2's
// parameters) from C++ through public CPython calls only. The names of torch's
// private attributes are not spelled here: python/coalesced_bcast/_torch_internals.py
// names them and hands them over once (set_torch_names), and each is interned
// then, so that a read costs no hashing of a name made per call. Reads treat
// anything unexpected as "not an object as we know it" (the caller then falls
// back to Python or judges conservatively).
#pragma once

#include <torch/extension.h>

namespace coalesced_bcast {

namespace py = pybind11;

// Interned attribute names (new references, kept for the process's life).
struct TorchNames {
  // nn.Module
  PyObject* modules = nullptr;               // its children dict
  PyObject* parameters = nullptr;            // its parameters dict
  PyObject* buffers = nullptr;               // its buffers dict
  PyObject* load_pre_hooks = nullptr;        // its load_state_dict pre-hooks dict
  PyObject* load_post_hooks = nullptr;       // its load_state_dict post-hooks dict
  PyObject* load_from_state_dict = nullptr;  // the method load_state_dict calls per module
  // DTensor and its spec
  PyObject* local_tensor = nullptr;
  PyObject* spec = nullptr;
  PyObject* spec_mesh = nullptr;
  PyObject* spec_placements = nullptr;
  // FSDP2's per-parameter object (FSDPParam) and its module info
  PyObject* fsdp_sharded_param = nullptr;
  PyObject* fsdp_sharded_param_data = nullptr;
  PyObject* fsdp_module_info = nullptr;
  PyObject* fsdp_pin_memory = nullptr;
  PyObject* fsdp_info_module = nullptr;
  PyObject* fsdp_info_param_name = nullptr;
  std::string fsdp_param_type;           // the FSDPParam class's name
  std::string fsdp_param_module_suffix;  // how the module defining FSDP2's post-hook ends
  // Public names, interned here
  PyObject* get_extra_state = nullptr;
  PyObject* module_name = nullptr;  // __module__
  PyObject* dim = nullptr;          // Shard(d).dim
  PyObject* shape = nullptr;        // DeviceMesh.shape
};

// Takes the adapter's {role: name} map; raises ValueError naming a role it lacks.
void set_torch_names(const py::dict& names);

// The names, under the GIL; where none were handed over yet, imports the adapter
// (whose import hands them over) first.
const TorchNames& torch_names();

// obj.name as a new reference, or empty with the error cleared.
py::object attr_or_empty(PyObject* obj, PyObject* name);

// obj.name as a new reference; raises the attribute's error.
py::object attr_or_raise(PyObject* obj, PyObject* name);

// m.name as a new reference if it is a dict (with `mappings`, also any other
// object with .items(), which for_items reads), else empty (any error cleared).
// Read from `own`, the instance's __dict__ (may be null), where nn.Module
// keeps its dicts (getattr on a module goes through the type's __getattr__
// hook); getattr where it is not there.
py::object dict_attr(PyObject* m, PyObject* own, PyObject* name, bool mappings = false);

// fn(key, value) over d's items in the order .items() gives them, as torch's
// walks read them: a plain dict by PyDict_Next; a subclass (torch before 2.5
// keeps OrderedDicts, whose order move_to_end changes) through .items().
// False on an error (cleared) or where fn returns false.
template <typename Fn>
bool for_items(PyObject* d, const Fn& fn) {
  if (PyDict_CheckExact(d)) {
    Py_ssize_t pos = 0;
    PyObject *key = nullptr, *value = nullptr;
    while (PyDict_Next(d, &pos, &key, &value)) {
      if (!fn(key, value)) return false;
    }
    return true;
  }
  py::object items = py::reinterpret_steal<py::object>(PyObject_CallMethod(d, "items", nullptr));
  py::object it = items ? py::reinterpret_steal<py::object>(PyObject_GetIter(items.ptr())) : py::object();
  if (!it) {
    PyErr_Clear();
    return false;
  }
  while (PyObject* raw = PyIter_Next(it.ptr())) {
    py::object item = py::reinterpret_steal<py::object>(raw);
    if (!PyTuple_Check(raw) || PyTuple_GET_SIZE(raw) != 2) return false;
    if (!fn(PyTuple_GET_ITEM(raw, 0), PyTuple_GET_ITEM(raw, 1))) return false;
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

}  // namespace coalesced_bcast

// module_attrs: reading nn.Module objects from C++ (module_walk, post_hooks):
// the attribute names, interned once (a name made per read costs its hashing),
// and reads that treat anything unexpected as "not a module as we know it"
// (the caller then falls back to Python or judges conservatively).
#pragma once

#include <torch/extension.h>

namespace coalesced_bcast {

namespace py = pybind11;

struct ModuleAttrs {
  PyObject* modules;
  PyObject* parameters;
  PyObject* buffers;
  PyObject* get_extra_state;
  PyObject* load_post_hooks;  // _load_state_dict_post_hooks
  PyObject* load_pre_hooks;   // _load_state_dict_pre_hooks
  PyObject* load_from_state_dict;  // _load_from_state_dict
  PyObject* module_name;      // __module__
};

// Made under the GIL, on first use.
const ModuleAttrs& module_attrs();

// obj.name as a new reference, or empty with the error cleared.
py::object attr_or_empty(PyObject* obj, PyObject* name);

// m.name as a new reference if it is a dict, else empty (any error cleared).
// Read from `own`, the instance's __dict__ (may be null), where nn.Module
// keeps its dicts (getattr on a module goes through the type's __getattr__
// hook); getattr where it is not there.
py::object dict_attr(PyObject* m, PyObject* own, PyObject* name);

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

#include "module_attrs.h"

namespace coalesced_bcast {

const ModuleAttrs& module_attrs() {
  static const ModuleAttrs a{
      PyUnicode_InternFromString("_modules"),
      PyUnicode_InternFromString("_parameters"),
      PyUnicode_InternFromString("_buffers"),
      PyUnicode_InternFromString("get_extra_state"),
      PyUnicode_InternFromString("_load_state_dict_post_hooks"),
      PyUnicode_InternFromString("_load_state_dict_pre_hooks"),
      PyUnicode_InternFromString("_load_from_state_dict"),
      PyUnicode_InternFromString("__module__"),
  };
  return a;
}

py::object attr_or_empty(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

py::object dict_attr(PyObject* m, PyObject* own, PyObject* name) {
  PyObject* v = own != nullptr ? PyDict_GetItemWithError(own, name) : nullptr;  // borrowed
  if (v != nullptr) {
    Py_INCREF(v);
  } else {
    PyErr_Clear();
    v = PyObject_GetAttr(m, name);
    if (v == nullptr) PyErr_Clear();
  }
  if (v != nullptr && !PyDict_Check(v)) Py_CLEAR(v);
  return py::reinterpret_steal<py::object>(v);
}

}  // namespace coalesced_bcast

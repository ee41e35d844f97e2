#include "module_walk.h"

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "chunks.h"
#include "module_attrs.h"

namespace coalesced_bcast {
namespace {

// A module's three dicts, read through its __dict__ once; false where one is
// not a dict. Its children are prefetched: siblings' misses overlap.
struct ModuleDicts {
  py::object children, parameters, buffers;
};

bool read_module(PyObject* m, ModuleDicts& out) {
  const auto& a = module_attrs();
  py::object own = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(m, nullptr));
  if (!own) PyErr_Clear();
  out = {dict_attr(m, own.ptr(), a.modules), dict_attr(m, own.ptr(), a.parameters),
         dict_attr(m, own.ptr(), a.buffers)};
  if (!out.children || !out.parameters || !out.buffers) return false;
  if (PyDict_CheckExact(out.children.ptr())) {
    Py_ssize_t pos = 0;
    PyObject *key = nullptr, *child = nullptr;
    while (PyDict_Next(out.children.ptr(), &pos, &key, &child)) prefetch_object(child);
  }
  return true;
}

// named_modules()'s preorder; with dedupe each module once (its memo).
bool preorder(PyObject* m, bool dedupe, std::unordered_set<PyObject*>& memo, std::vector<ModuleDicts>& out) {
  if (dedupe && !memo.insert(m).second) return true;
  out.emplace_back();
  if (!read_module(m, out.back())) return false;
  py::object children = out.back().children;  // out may move as it grows
  return for_items(children.ptr(), [&](PyObject*, PyObject* child) {
    return child == Py_None || preorder(child, dedupe, memo, out);
  });
}

// A dict's object and the start of its keys table (a module's are small: their
// entries lie there), so that the pass below does not wait on each in turn.
constexpr size_t kAhead = 8;
void prefetch_dict(PyObject* d, bool keys) {
  if (!keys) {
    prefetch_object(d);
    return;
  }
  const auto* k = reinterpret_cast<const char*>(reinterpret_cast<PyDictObject*>(d)->ma_keys);
  __builtin_prefetch(k);
  __builtin_prefetch(k + 64);
}

struct LoadWalk {
  PyObject* base;
  std::string extra_key;
  std::unordered_map<PyTypeObject*, bool> overrides;  // per type: get_extra_state is not base
  std::vector<PyObject*> path;  // names from the root, borrowed from the _modules dicts
  py::dict extra;
  IdSet owned;

  bool overridden(PyObject* m) {
    auto [it, fresh] = overrides.try_emplace(Py_TYPE(m), false);
    if (fresh) {
      PyObject* f = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(m)), module_attrs().get_extra_state);
      if (f == nullptr) PyErr_Clear();
      it->second = f != nullptr && f != base;
      Py_XDECREF(f);
    }
    return it->second;
  }

  bool add_ids(PyObject* d) {
    return for_items(d, [&](PyObject*, PyObject* value) {
      if (value != Py_None) owned.add(reinterpret_cast<uintptr_t>(value));  // a registered None
      return true;
    });
  }

  bool walk(PyObject* m) {
    ModuleDicts d;
    if (!read_module(m, d)) return false;
    if (!add_ids(d.parameters.ptr()) || !add_ids(d.buffers.ptr())) return false;
    if (overridden(m)) {
      std::string key;
      for (PyObject* name : path) {
        Py_ssize_t len = 0;
        const char* s = PyUnicode_AsUTF8AndSize(name, &len);
        if (s == nullptr) throw py::error_already_set();
        key.append(s, len).push_back('.');
      }
      extra[py::str(key + extra_key)] = py::handle(m);
    }
    return for_items(d.children.ptr(), [&](PyObject* key, PyObject* child) {
      if (child == Py_None) return true;
      if (!PyUnicode_Check(key)) return false;
      path.push_back(key);
      const bool ok = walk(child);
      path.pop_back();
      return ok;
    });
  }
};

}  // namespace

py::object load_walk(const py::handle& module, const py::handle& base, const std::string& extra_key) {
  LoadWalk w{base.ptr(), extra_key};
  if (!w.walk(module.ptr())) return py::none();
  return py::make_tuple(w.extra, py::cast(std::move(w.owned)));
}

py::object module_slots(const py::handle& module, bool include_buffers, bool dedupe) {
  std::vector<ModuleDicts> mods;
  std::unordered_set<PyObject*> memo;
  if (!preorder(module.ptr(), dedupe, memo, mods)) return py::none();
  py::list owners, keys, tensors;
  std::unordered_set<PyObject*> seen;
  for (int kind = 0; kind < (include_buffers ? 2 : 1); ++kind) {
    auto dict_of = [&](size_t i) { return (kind == 0 ? mods[i].parameters : mods[i].buffers).ptr(); };
    for (size_t i = 0; i < mods.size(); ++i) {
      if (i + 2 * kAhead < mods.size()) prefetch_dict(dict_of(i + 2 * kAhead), false);
      if (i + kAhead < mods.size()) prefetch_dict(dict_of(i + kAhead), true);
      PyObject* d = dict_of(i);
      const bool read = for_items(d, [&](PyObject* key, PyObject* value) {
        if (value == Py_None || (dedupe && !seen.insert(value).second)) return true;
        owners.append(py::handle(d));
        keys.append(py::handle(key));
        tensors.append(py::handle(value));
        return true;
      });
      if (!read) return py::none();
    }
  }
  return py::make_tuple(owners, keys, tensors);
}

}  // namespace coalesced_bcast

#include "module_walk.h"

#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "chunks.h"
#include "module_attrs.h"

namespace coalesced_bcast {
namespace {

// A module's three dicts, read through its __dict__ once; false where one is
// not a dict (with `mappings`, not a mapping with .items()). Its children are
// prefetched: siblings' misses overlap.
struct ModuleDicts {
  py::object children, parameters, buffers;
};

// pre_hooks: where given, the module's load pre-hooks too (empty where it has no such mapping).
bool read_module(PyObject* m, ModuleDicts& out, py::object* pre_hooks = nullptr, bool mappings = false) {
  const auto& a = torch_names();
  py::object own = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(m, nullptr));
  if (!own) PyErr_Clear();
  out = {dict_attr(m, own.ptr(), a.modules, mappings), dict_attr(m, own.ptr(), a.parameters, mappings),
         dict_attr(m, own.ptr(), a.buffers, mappings)};
  if (pre_hooks != nullptr) *pre_hooks = dict_attr(m, own.ptr(), a.load_pre_hooks, mappings);
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

// How many dicts ahead the pass below asks for a dict's lines, so that it does
// not wait on each in turn.
constexpr size_t kAhead = 8;

struct LoadWalk {
  PyObject* base;
  std::string extra_key;
  std::unordered_map<PyTypeObject*, bool> overrides;  // per type: get_extra_state is not base
  std::unordered_map<PyTypeObject*, bool> own_loaders;  // per type: _load_from_state_dict is not torch's
  std::vector<PyObject*> path;  // names from the root, borrowed from the _modules dicts
  py::dict extra;
  IdSet owned;
  py::list custom = py::list();  // (prefix, module): load logic of its own, or load pre-hooks, for Python to judge

  // "a.b." for the module at the current path.
  std::string prefix() const {
    std::string key;
    for (PyObject* name : path) {
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(name, &len);
      if (s == nullptr) throw py::error_already_set();
      key.append(s, len).push_back('.');
    }
    return key;
  }

  // Whether the type's _load_from_state_dict is other than torch's own (nn.Module's, batch norm's, ...):
  // defined in a module outside the torch package.
  bool own_loader(PyObject* m) {
    auto [it, fresh] = own_loaders.try_emplace(Py_TYPE(m), false);
    if (fresh) {
      const auto& a = torch_names();
      py::object f = attr_or_empty(reinterpret_cast<PyObject*>(Py_TYPE(m)), a.load_from_state_dict);
      py::object where = f ? attr_or_empty(f.ptr(), a.module_name) : py::object();
      const char* s = where && PyUnicode_Check(where.ptr()) ? PyUnicode_AsUTF8(where.ptr()) : nullptr;
      if (s == nullptr) PyErr_Clear();
      it->second = s == nullptr || !(std::strcmp(s, "torch") == 0 || std::strncmp(s, "torch.", 6) == 0);
    }
    return it->second;
  }

  bool overridden(PyObject* m) {
    auto [it, fresh] = overrides.try_emplace(Py_TYPE(m), false);
    if (fresh) {
      PyObject* f = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(m)), torch_names().get_extra_state);
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
    py::object pre_hooks;
    if (!read_module(m, d, &pre_hooks, /*mappings=*/true)) return false;
    if (!add_ids(d.parameters.ptr()) || !add_ids(d.buffers.ptr())) return false;
    if (overridden(m)) extra[py::str(prefix() + extra_key)] = py::handle(m);
    const int has_pre_hooks = pre_hooks ? PyObject_IsTrue(pre_hooks.ptr()) : 0;
    if (has_pre_hooks < 0) throw py::error_already_set();
    if (has_pre_hooks > 0 || own_loader(m)) {
      custom.append(py::make_tuple(py::str(prefix()), py::handle(m)));
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
  return py::make_tuple(w.extra, py::cast(std::move(w.owned)), w.custom);
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
      if (i + kAhead < mods.size()) prefetch_object(dict_of(i + kAhead));
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

// module_walk: a module tree's parameters and buffers, read from its dicts in
// one C++ pass. nn.Module.named_parameters() walks through generators that
// build a dotted name per module and hash every tensor: on a Mixture-of-Experts
// model in the Hugging Face layout (a module per expert matrix) that walk, not
// the broadcast, was a one-shot sync's host cost (sync.py module_states).
#pragma once

#include <torch/extension.h>

#include "id_table.h"

namespace coalesced_bcast {

namespace py = pybind11;

// (owners, keys, tensors) in named_parameters()/named_buffers() order (all
// parameters, then all buffers, each in named_modules() preorder), None values
// passed over: tensors[i] is owners[i][keys[i]]. dedupe: each module and each
// tensor once, as named_parameters() does by default; otherwise a module
// reached twice is read twice (tied names kept). Dicts are read in .items()
// order (OrderedDicts, as torch before 2.5 keeps, included). None where some
// module's _modules, _parameters or _buffers is not a dict (the caller walks in
// Python).
py::object module_slots(const py::handle& module, bool include_buffers, bool dedupe);

// For a load, walked as state_dict() walks (every path, a module reached twice
// read twice): (extra, owned, custom) with extra the state-dict key of each
// module whose type's get_extra_state is not `base` ("<path>._extra_state" ->
// module), owned the ids of the tree's parameters and buffers, an IdSet, and
// custom the (prefix, module) of each module with load pre-hooks or a
// _load_from_state_dict not defined in torch (state_dict.py _walk_modules).
// A module's dicts may be any mapping with .items() (read through it); None
// where one is missing or is not such a mapping.
py::object load_walk(const py::handle& module, const py::handle& base, const std::string& extra_key);

}  // namespace coalesced_bcast

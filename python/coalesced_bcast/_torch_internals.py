"""The one place that names torch's private attributes this package reads.

torch gives no public API for some of what the package needs at many keys (a module's own dicts, a
DTensor's local tensor without a property call, FSDP2's per-parameter state), so it reads private
attributes. Each is named here once: the C++ extension gets its names from ``CPP_NAMES`` (handed over
by ``_C.set_attribute_names`` when this module is imported; the extension imports it on first use),
and Python modules import the constants. ``INTERNALS`` lists every one with the object that holds it
and what it is there; tests/test_torch_internals.py builds each object on the running torch and fails,
naming the attribute and torch's version, when a release renames or retypes one.

=================================  ==========================================  ===============================
attribute                          held by                                     read in
=================================  ==========================================  ===============================
``_modules``                       nn.Module (dict of children)                C++ module_walk, post_hooks;
                                                                               state_dict.py
``_parameters``                    nn.Module (dict)                            C++ module_walk, post_hooks;
                                                                               fsdp.py, sync.py, state_dict.py
``_buffers``                       nn.Module (dict)                            C++ module_walk; fsdp.py,
                                                                               sync.py, state_dict.py
``_load_state_dict_pre_hooks``     nn.Module (dict)                            C++ module_walk; state_dict.py
``_load_state_dict_post_hooks``    nn.Module (dict)                            C++ post_hooks; state_dict.py
``_load_from_state_dict``          nn.Module type (method)                     C++ module_walk; state_dict.py
``hook``                           a load pre-hook's wrapper (_WrappedHook)    state_dict.py
``_EXTRA_STATE_KEY_SUFFIX``        torch.nn.modules.module (str)               state_dict.py
``_metadata``                      a state_dict() (dict of versions)           state_dict.py
``_local_tensor``                  DTensor (its shard)                         C++ load_dests, first_device;
                                                                               refit.py
``_spec``                          DTensor (DTensorSpec)                       C++ load_dests
``mesh``, ``placements``           DTensorSpec (a private class)               C++ load_dests
``compute_local_shape_and_         torch.distributed.tensor._utils             state_dict.py
global_offset``                    (torch 2.4: torch.distributed._tensor)
``FSDPParam``                      FSDP2's per-parameter class (its name)      C++ post_hooks
``._fsdp_param``                   the end of its module's name                C++ post_hooks
``sharded_param``                  FSDPParam (nn.Parameter, a DTensor)         C++ post_hooks
``_sharded_param_data``            FSDPParam (its padded 1-D storage)          C++ post_hooks
``_module_info``                   FSDPParam (ParamModuleInfo)                 C++ post_hooks
``pin_memory``                     FSDPParam (bool)                            C++ post_hooks
``module``, ``param_name``         ParamModuleInfo                             C++ post_hooks
``torch.distributed.fsdp``         the package FSDP's hooks are defined under  state_dict.py
``_get_backend``                   ProcessGroup (method)                       agree.py
``_device_types``                  ProcessGroup (list of devices)              agree.py, install.py, refit.py
``options._timeout``               a backend (timedelta)                       agree.py
``_set_default_timeout``           ProcessGroupNCCL (method)                   agree.py
``_get_process_group_store``       torch.distributed.distributed_c10d          agree.py
``_register_backend``,             ProcessGroup (methods; the last one from    refit.py
``_set_group_name``,               torch 2.5 on)
``_set_group_desc``,
``_set_default_backend``
``_sync_module_params_and_``       torch.distributed.fsdp._init_utils          install.py (patched)
``buffers``, ``_sync_params_and_
buffers``, ``_check_module_states_
for_sync_module_states``,
``_materialize_with_param_init_
fn``, ``_get_modules_to_
materialize``
``FSDP_SYNCED`` (_fsdp_synced)     torch.distributed.fsdp._init_utils          install.py
``FSDP_WRAPPED_MODULE``            torch.distributed.fsdp._common_utils        install.py
``FlatParamHandle.flatten_``       torch.distributed.fsdp._flat_param          install.py (patched)
``tensors``
``_sync_module_states``,           torch.nn.parallel.distributed               install.py (patched)
``_verify_param_shape_across_
processes``
=================================  ==========================================  ===============================
"""
from __future__ import annotations

from typing import NamedTuple

# nn.Module
MODULES = "_modules"
PARAMETERS = "_parameters"
BUFFERS = "_buffers"
LOAD_PRE_HOOKS = "_load_state_dict_pre_hooks"
LOAD_POST_HOOKS = "_load_state_dict_post_hooks"
LOAD_FROM_STATE_DICT = "_load_from_state_dict"
WRAPPED_HOOK = "hook"  # the function inside torch's wrapper of a load pre-hook
EXTRA_STATE_SUFFIX_ATTR = "_EXTRA_STATE_KEY_SUFFIX"  # of torch.nn.modules.module
STATE_DICT_METADATA = "_metadata"

# DTensor
LOCAL_TENSOR = "_local_tensor"
SPEC = "_spec"
SPEC_MESH = "mesh"
SPEC_PLACEMENTS = "placements"
DTENSOR_UTILS = ("torch.distributed.tensor._utils", "torch.distributed._tensor._utils")  # newest first
COMPUTE_LOCAL_SHAPE_AND_OFFSET = "compute_local_shape_and_global_offset"

# FSDP2 (fully_shard)
FSDP_PARAM_TYPE = "FSDPParam"
FSDP_PARAM_MODULE_SUFFIX = "._fsdp_param"
FSDP_SHARDED_PARAM = "sharded_param"
FSDP_SHARDED_PARAM_DATA = "_sharded_param_data"
FSDP_MODULE_INFO = "_module_info"
FSDP_PIN_MEMORY = "pin_memory"
FSDP_INFO_MODULE = "module"
FSDP_INFO_PARAM_NAME = "param_name"
FSDP_PACKAGE = "torch.distributed.fsdp"

# ProcessGroup and its backends
PG_GET_BACKEND = "_get_backend"
PG_DEVICE_TYPES = "_device_types"
BACKEND_OPTIONS_TIMEOUT = "_timeout"  # of a backend's .options
NCCL_SET_DEFAULT_TIMEOUT = "_set_default_timeout"
C10D = "torch.distributed.distributed_c10d"
C10D_GROUP_STORE = "_get_process_group_store"
PG_REGISTER_BACKEND = "_register_backend"
PG_SET_GROUP_NAME = "_set_group_name"
PG_SET_GROUP_DESC = "_set_group_desc"
PG_SET_DEFAULT_BACKEND = "_set_default_backend"  # torch 2.5 on

# FSDP1 and DDP, patched by install()
FSDP1_INIT = "torch.distributed.fsdp._init_utils"
FSDP1_SYNC_MODULE = "_sync_module_params_and_buffers"
FSDP1_SYNC_PARAMS = "_sync_params_and_buffers"
FSDP1_CHECK_STATES = "_check_module_states_for_sync_module_states"
FSDP1_MATERIALIZE = "_materialize_with_param_init_fn"
FSDP1_MODULES_TO_MATERIALIZE = "_get_modules_to_materialize"
FSDP1_SYNCED_ATTR = "FSDP_SYNCED"
FSDP1_COMMON = "torch.distributed.fsdp._common_utils"
FSDP1_WRAPPED_MODULE_ATTR = "FSDP_WRAPPED_MODULE"
FSDP1_FLAT_PARAM = "torch.distributed.fsdp._flat_param"
FSDP1_FLATTEN = "flatten_tensors"  # of FlatParamHandle
DDP = "torch.nn.parallel.distributed"
DDP_SYNC_STATES = "_sync_module_states"
DDP_VERIFY_SHAPES = "_verify_param_shape_across_processes"

# The names the C++ extension reads, by the role it gives each (csrc/module_attrs.h).
CPP_NAMES = {
    "modules": MODULES,
    "parameters": PARAMETERS,
    "buffers": BUFFERS,
    "load_pre_hooks": LOAD_PRE_HOOKS,
    "load_post_hooks": LOAD_POST_HOOKS,
    "load_from_state_dict": LOAD_FROM_STATE_DICT,
    "local_tensor": LOCAL_TENSOR,
    "spec": SPEC,
    "spec_mesh": SPEC_MESH,
    "spec_placements": SPEC_PLACEMENTS,
    "fsdp_param_type": FSDP_PARAM_TYPE,
    "fsdp_param_module_suffix": FSDP_PARAM_MODULE_SUFFIX,
    "fsdp_sharded_param": FSDP_SHARDED_PARAM,
    "fsdp_sharded_param_data": FSDP_SHARDED_PARAM_DATA,
    "fsdp_module_info": FSDP_MODULE_INFO,
    "fsdp_pin_memory": FSDP_PIN_MEMORY,
    "fsdp_info_module": FSDP_INFO_MODULE,
    "fsdp_info_param_name": FSDP_INFO_PARAM_NAME,
}


class Internal(NamedTuple):
    """One private attribute: `name` on the object `owner` names (a key of the test's builders, or a
    module path), expected to be a `kind` (dict, callable, tensor, str, bool, object, ...); `optional`:
    the package checks for it first (absent on some supported torch)."""
    name: str
    owner: str
    kind: str
    optional: bool = False


INTERNALS = (
    Internal(MODULES, "module", "dict"),
    Internal(PARAMETERS, "module", "dict"),
    Internal(BUFFERS, "module", "dict"),
    Internal(LOAD_PRE_HOOKS, "module", "dict"),
    Internal(LOAD_POST_HOOKS, "module", "dict"),
    Internal(LOAD_FROM_STATE_DICT, "batch_norm", "callable"),
    Internal(WRAPPED_HOOK, "wrapped_pre_hook", "callable"),
    Internal(EXTRA_STATE_SUFFIX_ATTR, "torch.nn.modules.module", "str"),
    Internal(STATE_DICT_METADATA, "state_dict", "dict"),
    Internal(LOCAL_TENSOR, "dtensor", "tensor"),
    Internal(SPEC, "dtensor", "object"),
    Internal(SPEC_MESH, "dtensor_spec", "device_mesh"),
    Internal(SPEC_PLACEMENTS, "dtensor_spec", "tuple"),
    Internal(COMPUTE_LOCAL_SHAPE_AND_OFFSET, "dtensor_utils", "callable"),
    Internal(FSDP_SHARDED_PARAM, "fsdp_param", "tensor"),
    Internal(FSDP_SHARDED_PARAM_DATA, "fsdp_param", "tensor"),
    Internal(FSDP_MODULE_INFO, "fsdp_param", "object"),
    Internal(FSDP_PIN_MEMORY, "fsdp_param", "bool"),
    Internal(FSDP_INFO_MODULE, "fsdp_module_info", "module"),
    Internal(FSDP_INFO_PARAM_NAME, "fsdp_module_info", "str"),
    Internal(PG_GET_BACKEND, "process_group", "callable"),
    Internal(PG_DEVICE_TYPES, "process_group", "list", optional=True),
    Internal(BACKEND_OPTIONS_TIMEOUT, "gloo_options", "timedelta", optional=True),
    Internal(NCCL_SET_DEFAULT_TIMEOUT, "nccl_class", "callable", optional=True),
    Internal(C10D_GROUP_STORE, C10D, "callable"),
    Internal(PG_REGISTER_BACKEND, "process_group", "callable"),
    Internal(PG_SET_GROUP_NAME, "process_group", "callable"),
    Internal(PG_SET_GROUP_DESC, "process_group", "callable"),
    Internal(PG_SET_DEFAULT_BACKEND, "process_group", "callable", optional=True),
    Internal(FSDP1_SYNC_MODULE, FSDP1_INIT, "callable"),
    Internal(FSDP1_SYNC_PARAMS, FSDP1_INIT, "callable"),
    Internal(FSDP1_CHECK_STATES, FSDP1_INIT, "callable"),
    Internal(FSDP1_MATERIALIZE, FSDP1_INIT, "callable"),
    Internal(FSDP1_MODULES_TO_MATERIALIZE, FSDP1_INIT, "callable"),
    Internal(FSDP1_SYNCED_ATTR, FSDP1_INIT, "str"),
    Internal(FSDP1_WRAPPED_MODULE_ATTR, FSDP1_COMMON, "str"),
    Internal(FSDP1_FLATTEN, FSDP1_FLAT_PARAM + ".FlatParamHandle", "callable"),
    Internal(DDP_SYNC_STATES, DDP, "callable"),
    Internal(DDP_VERIFY_SHAPES, DDP, "callable"),
)


def hand_to_cpp() -> None:
    """Give the C++ extension the names it reads (it interns each once)."""
    from . import _C
    _C.set_attribute_names(CPP_NAMES)


hand_to_cpp()

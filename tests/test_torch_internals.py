"""Every private attribute of torch that the package reads (coalesced_bcast/_torch_internals.py), looked up on
real torch objects of the running release: one that a release renames or retypes fails here with a message
naming the attribute, the object and torch's version, before a load or sync reads it. FSDP2's and DTensor's
parts run where this torch builds them on the CPU (a 1-rank gloo group), and skip with the reason elsewhere."""
from __future__ import annotations

import datetime
import gc
import importlib
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from coalesced_bcast import _C
from coalesced_bcast import _torch_internals as TI

KINDS = {
    "dict": lambda v: isinstance(v, dict),
    "callable": callable,
    "tensor": lambda v: isinstance(v, torch.Tensor),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: v is not None,
    "module": lambda v: isinstance(v, nn.Module),
    "list": lambda v: isinstance(v, (list, tuple)),
    "tuple": lambda v: isinstance(v, tuple),
    "timedelta": lambda v: isinstance(v, datetime.timedelta),
    "device_mesh": lambda v: type(v).__name__ == "DeviceMesh",
}


def _where(internal: TI.Internal, obj) -> str:
    return (f"torch {torch.__version__}: {internal.name!r} on {internal.owner} ({type(obj).__module__}."
            f"{type(obj).__qualname__}), named in coalesced_bcast/_torch_internals.py")


def check(internal: TI.Internal, obj) -> None:
    """obj.<name> exists and is of the internal's kind; an optional one may be absent."""
    if not hasattr(obj, internal.name):
        if internal.optional:
            return
        pytest.fail(f"{_where(internal, obj)}: no such attribute")
    value = getattr(obj, internal.name)
    assert KINDS[internal.kind](value), f"{_where(internal, obj)}: a {type(value).__qualname__}, not a {internal.kind}"


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo group in this process, destroyed after the module's tests."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            gc.collect()
            time.sleep(0.05)  # torch 2.4's gloo destructor and its workers: as tests/dist_utils.py
            dist.destroy_process_group()


def _pre_hook(*args, **kwargs):
    return None


def _module_objects() -> dict:
    m = nn.Linear(2, 2)
    register = getattr(m, "register_load_state_dict_pre_hook", None)
    if register is not None:
        register(_pre_hook)
    else:  # torch before the public registration: the private one, with the module
        m._register_load_state_dict_pre_hook(_pre_hook, with_module=True)
    wrapped = next(iter(getattr(m, TI.LOAD_PRE_HOOKS).values()))
    return {"module": m, "batch_norm": type(nn.BatchNorm1d(2)), "wrapped_pre_hook": wrapped,
            "state_dict": m.state_dict()}


def _dtensor_api():
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:
        try:
            from torch.distributed._tensor import Shard, distribute_tensor  # torch 2.4
        except ImportError:
            pytest.skip(f"torch {torch.__version__} has no DTensor")
    return Shard, distribute_tensor


def _dtensor_objects(group) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    Shard, distribute_tensor = _dtensor_api()
    dt = distribute_tensor(torch.arange(8.0).view(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    utils = None
    for path in TI.DTENSOR_UTILS:
        try:
            utils = importlib.import_module(path)
            break
        except ImportError:
            continue
    return {"dtensor": dt, "dtensor_spec": getattr(dt, TI.SPEC), "dtensor_utils": utils}


def _fsdp2_model(group) -> nn.Module:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no public FSDP2 (torch.distributed.fsdp.fully_shard), "
                    "which runs on the CPU from torch 2.6 on")
    from torch.distributed.device_mesh import init_device_mesh
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _fsdp2_objects(group) -> dict:
    model = _fsdp2_model(group)
    lin = model[0]
    hooks = list(getattr(lin, TI.LOAD_POST_HOOKS).values())
    assert hooks, f"torch {torch.__version__}: FSDP2 registers no load_state_dict post-hook on {type(lin)}"
    hook = hooks[0]
    where = f"torch {torch.__version__}: FSDP2's load_state_dict post-hook {hook!r}"
    assert (hook.__module__ or "").endswith(TI.FSDP_PARAM_MODULE_SUFFIX), \
        f"{where}: defined in {hook.__module__}, not a module ending {TI.FSDP_PARAM_MODULE_SUFFIX!r}"
    assert hook.__module__.startswith(TI.FSDP_PACKAGE), f"{where}: not under {TI.FSDP_PACKAGE}"
    cells = hook.__closure__ or ()
    fp = cells[0].cell_contents if cells else None
    assert type(fp).__name__ == TI.FSDP_PARAM_TYPE, \
        f"{where}: its closure's first cell holds a {type(fp).__qualname__}, not a {TI.FSDP_PARAM_TYPE}"
    return {"fsdp_param": fp, "fsdp_module_info": getattr(fp, TI.FSDP_MODULE_INFO), "fsdp_model": model}


def _group_objects(group) -> dict:
    out = {"process_group": group, "gloo_options": None, "nccl_class": getattr(dist, "ProcessGroupNCCL", None)}
    try:
        out["gloo_options"] = getattr(group, TI.PG_GET_BACKEND)(torch.device("cpu")).options
    except (AttributeError, RuntimeError):  # optional: agree.py falls back to a default deadline
        pass
    return out


def _owner(name: str):
    """A module path, or a module path and a class in it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        path, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(path), attr)


def _check_all(owners: dict, keys: set) -> None:
    for internal in TI.INTERNALS:
        if internal.owner in keys:
            obj = owners[internal.owner]
            if obj is None:
                assert internal.optional, f"torch {torch.__version__}: no {internal.owner} to read {internal.name}"
                continue
            check(internal, obj)


def test_every_internal_has_a_builder():
    known = {"module", "batch_norm", "wrapped_pre_hook", "state_dict", "dtensor", "dtensor_spec", "dtensor_utils",
             "fsdp_param", "fsdp_module_info", "process_group", "gloo_options", "nccl_class"}
    for internal in TI.INTERNALS:
        assert internal.owner in known or "." in internal.owner, internal
        assert internal.kind in KINDS, internal


def test_nn_module_internals():
    owners = _module_objects()
    _check_all(owners, {"module", "batch_norm", "wrapped_pre_hook", "state_dict"})
    assert owners["wrapped_pre_hook"].hook is _pre_hook, f"torch {torch.__version__}: the pre-hook wrapper's " \
        f"{TI.WRAPPED_HOOK!r} is not the hook registered"
    # module_walk.cpp judges a type's _load_from_state_dict torch's own by its __module__
    loader = getattr(owners["batch_norm"], TI.LOAD_FROM_STATE_DICT)
    assert loader.__module__.startswith("torch."), f"torch {torch.__version__}: {loader.__module__}"


def test_module_level_internals():
    for internal in TI.INTERNALS:
        if "." in internal.owner:
            try:
                owner = _owner(internal.owner)
            except (ImportError, AttributeError) as e:
                pytest.fail(f"torch {torch.__version__}: {internal.owner}, which holds {internal.name!r}, is "
                            f"gone ({e}); named in coalesced_bcast/_torch_internals.py")
            check(internal, owner)
    assert getattr(_owner(TI.FSDP1_INIT), TI.FSDP1_SYNCED_ATTR) == "_fsdp_synced"
    assert getattr(_owner(TI.FSDP1_COMMON), TI.FSDP1_WRAPPED_MODULE_ATTR) == "_fsdp_wrapped_module"


def test_process_group_internals(group):
    _check_all(_group_objects(group), {"process_group", "gloo_options", "nccl_class"})


def test_dtensor_internals(group):
    owners = _dtensor_objects(group)
    _check_all(owners, {"dtensor", "dtensor_spec", "dtensor_utils"})
    dt = owners["dtensor"]
    assert _C.first_device([dt], type(dt)) == (torch.device("cpu"), 0)  # the C++ read of its local tensor


def test_fsdp2_internals(group):
    owners = _fsdp2_objects(group)
    _check_all(owners, {"fsdp_param", "fsdp_module_info"})
    info = owners["fsdp_module_info"]
    assert getattr(info, TI.FSDP_INFO_MODULE) is owners["fsdp_model"][0]
    # The C++ judgment (post_hooks.cpp) reads the same chain through the names handed to it.
    lin = owners["fsdp_model"][0]
    hook = next(iter(getattr(lin, TI.LOAD_POST_HOOKS).values()))
    assert _C.idle_fsdp_hook(lin, hook), f"torch {torch.__version__}: FSDP2's post-hook right after fully_shard " \
        "is not judged idle: post_hooks.cpp no longer reads its chain"


def test_names_handed_to_cpp():
    _C.set_attribute_names(TI.CPP_NAMES)  # again: the same names
    lacking = dict(TI.CPP_NAMES)
    del lacking["spec"]
    with pytest.raises(ValueError, match="'spec'"):
        _C.set_attribute_names(lacking)
    m = nn.Sequential(nn.Linear(2, 2))  # the names still in place: the C++ walk reads the module's dicts
    tensors = _C.module_slots(m, True, False)[2]
    assert len(tensors) == 2 and tensors[0] is m[0].weight and tensors[1] is m[0].bias

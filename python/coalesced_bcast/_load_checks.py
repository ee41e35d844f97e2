"""What load_full_state_dict checks of the model before it plans: one walk of its modules (extra states, the
tensors it owns, load logic of its own), that load logic judged against what the load serves, and the device
it loads through."""
from __future__ import annotations

import functools
import types
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C, _dtensor
from ._load_keys import _EXTRA, _ModelState


def _control_device(pg: dist.ProcessGroup) -> torch.device:
    """The device the group's small messages (metadata, records) cross on."""
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _walk_modules(model: nn.Module) -> tuple[dict[str, nn.Module], Any, list]:
    """One walk the way state_dict() walks (csrc/module_walk.cpp): the state-dict keys that hold a module's extra
    state, the ids of the model's own parameters and buffers, a _C.IdSet (state_dict(keep_vars=True) returns
    those objects themselves, unless a hook copied one), and the (prefix, module) of each module with load logic
    that may be its own (load pre-hooks, or a _load_from_state_dict defined outside torch: _custom_load_logic
    judges)."""
    found = _C.load_walk(model, nn.Module.get_extra_state, _EXTRA)
    if found is None:
        raise TypeError("the module walk cannot read this model: some module's _modules, _parameters or _buffers "
                        "is not a mapping, or a child's name is not a string")
    return found


def _from_torch(fn: Any) -> bool:
    """Whether a hook or method is torch's own (defined in the torch package)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    where = fn.__module__ if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) else type(fn).__module__
    return isinstance(where, str) and (where == "torch" or where.startswith("torch."))


def _check_load_logic(custom: list, sd: Any, strict: bool, is_src: bool) -> None:
    """Raises where a module of the model (from _walk_modules) has load logic that load_state_dict would run and
    this load does not; the source runs the load pre-hooks on its checkpoint to see whether they change it."""
    unserved, hooks = _custom_load_logic(custom)
    if hooks and is_src and isinstance(sd, Mapping):
        unserved += _pre_hook_changes(hooks, sd, strict)
    if unserved:
        raise ValueError("load logic of the model's own that load_state_dict would run and this load "
                         "does not: " + "; ".join(unserved) + ". Load such a model with load_state_dict, "
                         "or pass skip_custom_load_logic=True where that logic does nothing that a "
                         "plain copy of the checkpoint's values into the tensors does not")


def _custom_load_logic(custom: list) -> tuple[list[str], list]:
    """Load logic in these modules (from _walk_modules) that load_state_dict would run and a load through the
    engine does not, as defined outside torch: the _load_from_state_dict overrides, worded per module (refused:
    they may do anything with the values), and the load pre-hooks, (prefix, module, hook) each (for
    _pre_hook_changes). Torch's own are served: FSDP2's resharding and checkpoint_wrapper's key prefix (whose
    state_dict hooks the model's keys already reflect), batch norm's num_batches_tracked, and the compatibility
    hooks of weight_norm, spectral_norm and lazy modules for checkpoints in older layouts (whose keys would not
    match here)."""
    overrides, hooks = [], []
    for prefix, m in custom:
        loader = type(m)._load_from_state_dict
        if not _from_torch(loader):
            overrides.append(f"{_module_words(prefix, m)} overrides _load_from_state_dict "
                             f"({getattr(loader, '__qualname__', loader)})")
        for hook in (getattr(m, "_load_state_dict_pre_hooks", None) or {}).values():
            if not _from_torch(getattr(hook, "hook", hook)):  # torch wraps each hook (_WrappedHook) with its module
                hooks.append((prefix, m, hook))
    return overrides, hooks


def _module_words(prefix: str, m: nn.Module) -> str:
    return f"{repr(prefix[:-1]) if prefix else 'the root module'} ({type(m).__qualname__})"


def _pre_hook_changes(hooks: list, sd: Mapping[str, Any], strict: bool) -> list[str]:
    """On the source: the load pre-hooks (from _custom_load_logic) run as load_state_dict runs them, each on the
    checkpoint's entries under its module's prefix; those that change a key or a value here (a legacy key
    renamed, a value unpacked or transposed), or report an error, worded. Hooks that change nothing for this
    checkpoint (the usual compatibility hooks, given a checkpoint in the current layout) need no running."""
    found = []
    metadata = getattr(sd, "_metadata", None) or {}
    for prefix, m, hook in hooks:
        local = {k: v for k, v in sd.items() if k.startswith(prefix)}
        before = dict(local)
        missing: list[str] = []
        unexpected: list[str] = []
        errors: list[str] = []
        fn = getattr(hook, "hook", hook)
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        what = f"{_module_words(prefix, m)} has a load_state_dict pre-hook ({name})"
        try:
            hook(local, prefix, metadata.get(prefix[:-1], {}), strict, missing, unexpected, errors)
        except Exception as e:
            found.append(f"{what} that raised {type(e).__name__}: {e}")
            continue
        changed = sorted(set(local) ^ set(before)) or [k for k in before if local[k] is not before[k]]
        if changed or errors or missing or unexpected:
            detail = f"changed '{changed[0]}'" if changed else f"reported {(errors or missing or unexpected)[0]!r}"
            found.append(f"{what} that {detail} for this checkpoint")
    return found


def _model_device(model_sd: Mapping[str, Any], state: _ModelState, extra: Mapping[str, nn.Module],
                  pg: dist.ProcessGroup) -> torch.device:
    """The device of the model's first tensor with elements; load_dests checks each loaded tensor against it."""
    # Read up to the first tensor only, where extra states are passed over.
    values = (v for k, v in model_sd.items() if k not in extra) if extra else state.values
    device, index = _C.first_device(values, _dtensor.classes()[0])

    def key() -> str:  # the key of value `index` (none found: the last), for an error
        keys = [k for k in state.keys if k not in extra]
        return keys[index] if keys else "(no tensor)"
    if device is not None and device.type == "meta":
        raise ValueError(f"'{key()}' is on the meta device: materialize the model first "
                         f"(model.to_empty(device=...))")
    device = device if device is not None else _control_device(pg)
    backend = str(dist.get_backend(pg))
    if device.type == "cpu" and "gloo" not in backend:
        ctrl = _control_device(pg)
        if ctrl.type == "cuda":
            # Host tensors (FSDP2's CPUOffloadPolicy) over a GPU group: the bytes cross on the group's GPU,
            # and the load writes them into host memory from there (load_plan.cpp: pinned or pageable).
            return ctrl
        raise ValueError(f"the model is in host memory ('{key()}') but the group's backend is {backend}, "
                         f"which has no host device to load through: use a gloo group")
    return device

"""load_full_state_dict: load a full state dict that one rank holds into a plain or FSDP2-sharded model
on every rank, streaming the source's bytes through the C++ engine's ring of buckets.

Python does what needs names: the source describes its checkpoint (keys, dtypes, shapes, which keys
share a tensor), every rank matches keys as load_state_dict does and finds the box of each tensor
that it holds (a DTensor shard, or all of it), and one agreement settles that every rank can load
before anything is written. The transfer is one C++ plan (``_C.load_plan``): the checkpoint tensors
laid out back to back in buckets of ``bucket_bytes``; the source packs each bucket (device tensors
and small pinned host tensors by a kernel, large pinned runs by the copy engine, pageable tensors by
``copy_threads`` threads through a pinned staging ring), it is broadcast, and every rank writes out
of it only its own shards, cast in the kernel where the model's dtype differs (csrc/load_plan.cpp,
csrc/executor_cuda.cu, csrc/scatter_cuda.cu). Shards in host memory (FSDP2's CPU offload) are written
from the GPU where pinned, and out of a pinned copy of each bucket by the same threads where pageable.

Memory: every rank holds ``ring_depth`` device buckets of ``bucket_bytes``; the source, when it
stages pageable host tensors, also ``ring_depth`` pinned host buckets, and a rank with shards in
pageable host memory another ``ring_depth``. Nothing the size of a tensor is allocated anywhere: a
tensor larger than a bucket is split across buckets.
"""
from __future__ import annotations

import array
import functools
import hashlib
import itertools
import logging
import os
import pickle
import time
import types
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C, _dtensor
from .agree import control_stream, host_reads_wait, payload_broadcast
from .sync import _PREPARE, DEFAULT_RING_DEPTH, _group_src, _resolve_group, gc_paused

logger = logging.getLogger(__name__)

_NBT = "num_batches_tracked"
_DOT_NBT = "." + _NBT
_EXTRA = getattr(nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")
_META_CHUNK = 512 << 10  # metadata moves in pieces this size: small-pool device blocks only
_RECORD = 4096  # bytes per rank in the verdict all_gather: 3 int64, then a UTF-8 message


class LoadStateDictError(RuntimeError):
    """Raised on every rank when any rank cannot load the source's state dict; no rank wrote anything."""


@dataclass(frozen=True)
class LoadStats:
    """What one load did on this rank; the counts of what was sent are the same on every rank."""

    keys: int  # state-dict keys loaded (tied names each count, extra states included)
    tensors: int  # distinct checkpoint tensors sent (keys sharing one tensor in the checkpoint count once)
    bytes: int  # checkpoint bytes sent, in the checkpoint's dtypes
    buckets: int
    cast_keys: int  # keys whose model dtype differs from the checkpoint's, cast on this rank's device
    missing_keys: tuple[str, ...]  # model keys absent from the checkpoint (left as they were)
    unexpected_keys: tuple[str, ...]  # checkpoint keys the model does not have (ignored)
    ring_bytes: int  # device bucket bytes held during the call (host bytes for a CPU model)
    host_ring_bytes: int  # pinned host bucket bytes (staging CPU sources into, or unstaging into pageable shards)
    seconds: float  # host wall time on this rank
    # buckets this rank received straight into its tensors (no slot, no copy): their bytes lie back to
    # back there in the checkpoint's dtype (whole tensors spanning buckets, or a model in one buffer)
    direct_buckets: int = 0
    # the source's first buckets, read from the checkpoint's host memory into its ring while it planned
    prepacked_buckets: int = 0
    # the source's host bytes sent up by batched copy-engine copies beside the copy kernel
    # (COALESCED_BCAST_HOST_BATCH_MIN)
    host_batched_bytes: int = 0


#: A load's ring slot. Half a sync's: a load's bytes all go through the ring (each rank writes its own
#: shards out of it), so its ring is always allocated whole, and 128 MiB buckets bought no clear gain
#: there (2x H200, 2026-12-01, bench/results/fsdp2_h200.jsonl: Llama-8B and MoE from pinned memory
#: within 1%, a pageable Llama-8B source slower).
DEFAULT_LOAD_BUCKET_BYTES: int = 64 << 20

@gc_paused
def load_full_state_dict(
    model: nn.Module,
    sd: Optional[Mapping[str, Any]],
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    *,
    bucket_bytes: int = DEFAULT_LOAD_BUCKET_BYTES,
    ring_depth: int = DEFAULT_RING_DEPTH,
    copy_threads: Optional[int] = None,
    progress_seconds: float = 5.0,
    timeout: Optional[Union[float, timedelta]] = None,
    skip_custom_load_logic: bool = False,
) -> LoadStats:
    """Load the source rank's full state dict ``sd`` into ``model`` on every rank, as
    ``model.load_state_dict(sd, strict)`` would on one process.

    Args:
        model: a plain module or an FSDP2 (``fully_shard``) model whose tensors have storage (after
            ``to_empty``); DTensor parameters and buffers may be ``Shard(d)`` and ``Replicate``
            over any mesh; each rank writes only its local shard.
        sd: on the source, a full state dict of plain tensors (CPU, pinned or pageable or mmap'ed,
            or on the model's GPU); on the other ranks ``None`` (anything passed there is ignored).
        src: the source's global rank.
        group: the process group (default: the world).
        strict: as in ``load_state_dict``: missing or unexpected keys raise on every rank.
        bucket_bytes: bytes per bucket (a multiple of 16, at least 4096); as in ``broadcast_tensors``.
        ring_depth: buckets in the ring; extra device memory is ``bucket_bytes * ring_depth``.
        copy_threads: CPU threads that copy pageable host memory: the source's tensors into pinned
            buckets, and on any rank buckets into the model's pageable host shards (default: up to 8).
        progress_seconds: the source logs bytes, GB/s and ETA at this interval for longer loads.
        timeout: seconds (or a timedelta) for each bucket's broadcast; default: the group's.
        skip_custom_load_logic: load modules with load logic of their own (below) as plain copies rather than
            refuse them.

    Keys are the model's ``state_dict()`` keys (persistent buffers only); a checkpoint value is cast to the model
    tensor's dtype on the device after transfer. As ``load_state_dict``: batch norm's ``num_batches_tracked`` may be
    absent from a checkpoint older than its version 2, a 1-dim checkpoint value of one element (torch 0.3's scalars)
    loads into a 0-dim tensor (of any length, its first element, where this torch's does so), keys under a child set
    to None are passed over, a module's extra state is taken only where it overrides ``set_extra_state``, expanded
    (stride-0) checkpoint tensors are read through their strides, tied parameters receive the value of their last
    key, and the model's post-hooks run afterwards, children first (FSDP2 registers one per parameter; those with
    nothing to do after the in-place writes are passed over) and may clear missing or unexpected keys: where the
    model has such hooks (any but FSDP's own) and ``strict`` finds keys, it is judged after them, so that error, as
    ``load_state_dict``'s, comes after the tensors are written. Unlike it, the tensors are written as plain copies
    of the checkpoint's values. Load logic that a model defines outside torch, which may rename, transform or derive
    values, is refused on every rank before anything is written, naming the module, unless
    ``skip_custom_load_logic``: a ``_load_from_state_dict`` override always, a load pre-hook where, run on the
    source's checkpoint as load_state_dict runs it, it changes a key or a value (a compatibility hook given a
    checkpoint in the current layout changes nothing and loads). Torch's own (FSDP2's, checkpoint_wrapper's, batch
    norm's, weight_norm's) are served. A ``set_extra_state`` that raises does so after the tensors are written.
    Non-persistent buffers are not in a state dict and are left as they are.
    Any other error (missing or unexpected keys under ``strict``, a shape mismatch, a bad value, a model that
    differs between ranks) is raised on every rank before any tensor is written. On CUDA the caller's current stream
    is made to wait for the load: the model can be used at once in stream order.
    """
    t0 = time.perf_counter()
    pg = _resolve_group(group)
    src_g = _group_src(pg, src)
    rank, is_src = dist.get_rank(), pg.rank() == src_g
    ctrl = _control_device(pg)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    early = _start_describe(sd) if is_src else None  # the source's tensors read while the model's state is
    with torch.no_grad():
        model_sd, extra_mods, owned, error = None, {}, _C.IdSet(()), None
        model_keys = _NO_MODEL_STATE
        try:
            model_sd = model.state_dict(keep_vars=True)  # FSDP2's pre-hook reshards first
            model_keys = _model_state(model_sd)
            extra_mods, owned, custom = _walk_modules(model)
            if custom and not skip_custom_load_logic:
                unserved, hooks = _custom_load_logic(custom)
                if hooks and is_src and isinstance(sd, Mapping):
                    unserved += _pre_hook_changes(hooks, sd, strict)
                if unserved:
                    raise ValueError("load logic of the model's own that load_state_dict would run and this load "
                                     "does not: " + "; ".join(unserved) + ". Load such a model with load_state_dict, "
                                     "or pass skip_custom_load_logic=True where that logic does nothing that a "
                                     "plain copy of the checkpoint's values into the tensors does not")
            device = _model_device(model_sd, model_keys, extra_mods, pg)
        except Exception as e:  # reported through the agreement below, so no rank is left waiting
            error, device = f"{type(e).__name__}: {e}", ctrl
        meta, src_tensors = None, None
        if is_src:
            try:
                meta, src_tensors = _describe_source(sd, extra_mods, device, error, bucket_bytes, ring_depth, rank,
                                                     model_sd, model_keys, early)
            except Exception as e:  # the others are already waiting for the metadata: tell them
                meta, src_tensors = dict(fatal=f"rank {rank}: {type(e).__name__}: {e}"), None
        early = None
        meta, unreadable = _broadcast_meta(meta, pg, src_g, ctrl, rank)
        if meta["fatal"]:
            raise LoadStateDictError(f"load_full_state_dict: source rank {src} refused, so no rank loaded "
                                     f"anything: {meta['fatal']}")
        # After the metadata is out: the other ranks plan from it meanwhile.
        prepack = (_prepack(meta, src_tensors, device, bucket_bytes, ring_depth, rank, copy_threads, model_sd,
                            model_keys, extra_mods) if is_src else None)
        plan = _plan_local(model, model_sd, model_keys, extra_mods, owned, meta, src_tensors, strict, device, rank,
                           error or unreadable, bucket_bytes, ring_depth, copy_threads)
        _prepare(plan, model, is_src, rank, bucket_bytes, prepack)
        prepack = None  # taken by the ring, or its own freed before the transfer makes one
        try:
            strict_after_hooks = _agree(plan, pg, src_g, ctrl, rank)
        except BaseException:
            plan.prepared = None  # its ring freed now, not when the traceback goes
            raise
        buckets, reads = _transfer(plan, pg, src_g, is_src, timeout, progress_seconds, t0)
        try:  # the source's copies of host memory may still run: the host does the rest meanwhile
            tensors, nbytes = plan.tensors, plan.total
            direct = plan.core.direct_buckets if plan.core is not None else 0
            plan.core = None  # FSDP2's post-hook may re-pad shards: let the engine's references go
            del model_sd, src_tensors
            hook_error = None
            try:
                for obj, mod in plan.extras:
                    mod.set_extra_state(obj)
                # They may edit the lists, as load_state_dict's.
                _run_post_hooks(model, plan.missing, plan.unexpected, None if plan.extras else plan.hooks)
            except Exception as e:
                if not strict_after_hooks:
                    raise
                hook_error = e  # the others wait for this rank's verdict below: it must reach them
            if strict_after_hooks:
                _strict_after_hooks(plan, model, strict, pg, ctrl, rank, hook_error)
        finally:
            if reads is not None:  # the caller may free or change the source's tensors once this returns
                host_reads_wait(reads, pg, timeout)
    stats = LoadStats(
        keys=plan.num_keys, tensors=tensors, bytes=nbytes, buckets=buckets,
        cast_keys=plan.cast_keys, missing_keys=tuple(plan.missing), unexpected_keys=tuple(plan.unexpected),
        ring_bytes=plan.ring_bytes, host_ring_bytes=plan.host_ring_bytes, seconds=time.perf_counter() - t0,
        direct_buckets=direct, prepacked_buckets=plan.prepacked, host_batched_bytes=plan.host_batched_bytes)
    if is_src:
        logger.info("load_full_state_dict: loaded %d keys (%d tensors, %.3f GiB, %d buckets, %d cast) in %.3f s, "
                    "%.2f GB/s", stats.keys, stats.tensors, stats.bytes / 2**30, stats.buckets, stats.cast_keys,
                    stats.seconds, stats.bytes / max(stats.seconds, 1e-9) / 1e9)
    return stats


# ---------------------------------------------------------------------------------------------------
# Agreement: the source describes its checkpoint, every rank plans against it, one verdict for all.


def _control_device(pg: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _walk_modules(model: nn.Module) -> tuple[dict[str, nn.Module], Any, list]:
    """One walk the way state_dict() walks: the state-dict keys that hold a module's extra state, the ids
    of the model's own parameters and buffers, a _C.IdSet (state_dict(keep_vars=True) returns those objects
    themselves, unless a hook copied one), and the (prefix, module) of each module with load logic that may be
    its own (load pre-hooks, or a _load_from_state_dict defined outside torch: _custom_load_logic judges)."""
    found = _C.load_walk(model, nn.Module.get_extra_state, _EXTRA)  # None: a module's state is not in dicts
    return found if found is not None else _walk_modules_py(model)


def _from_torch(fn: Any) -> bool:
    """Whether a hook or method is torch's own (defined in the torch package)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    where = fn.__module__ if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) else type(fn).__module__
    return isinstance(where, str) and (where == "torch" or where.startswith("torch."))


def _walk_modules_py(model: nn.Module) -> tuple[dict[str, nn.Module], Any, list]:
    """_walk_modules in Python, for modules whose dicts the C++ walk does not read."""
    base = nn.Module.get_extra_state
    extra: dict[str, nn.Module] = {}
    owned: set[int] = set()
    custom: list = []

    def walk(m: nn.Module, prefix: str) -> None:
        owned.update(id(t) for t in m._parameters.values() if t is not None)
        owned.update(id(t) for t in m._buffers.values() if t is not None)
        if type(m).get_extra_state is not base:
            extra[prefix + _EXTRA] = m
        if getattr(m, "_load_state_dict_pre_hooks", None) or not _from_torch(type(m)._load_from_state_dict):
            custom.append((prefix, m))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return extra, _C.IdSet(owned), custom


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


def _source_problem(v: Any) -> str:
    """Why a value that is not a plain tensor cannot be sent (plain tensors are checked in C++)."""
    if not isinstance(v, torch.Tensor):
        return f"a {type(v).__name__}, not a tensor"
    if isinstance(v, _dtensor.classes()[0]):
        return "a DTensor: the source must hold a full state dict of plain tensors"
    return f"a tensor subclass ({type(v).__name__}), not a plain tensor"


def _joined(keys: list) -> Optional[str]:
    """The keys joined by NULs where that splits back into them (every key a string without a NUL); else None.
    Keys compare, hash and cross the wire as one string: at 16k keys a list costs a Python step per key in each
    comparison and in pickling, most of them cache misses on strings made long before."""
    try:
        joined = "\0".join(keys)
    except TypeError:  # a key that is not a string
        return None
    return joined if joined.count("\0") == max(len(keys) - 1, 0) else None


def _keys_and_joined(d: Mapping[str, Any]) -> tuple[list, Optional[str]]:
    keys = list(d)
    return keys, _joined(keys)


class _ModelState(NamedTuple):
    """The model's state_dict() keys and values as lists, made while state_dict() has just touched every one of
    them (later, at 16k keys, each is a cache miss), and the keys joined (_joined)."""
    keys: list
    joined: Optional[str]
    values: list


_NO_MODEL_STATE = _ModelState([], None, [])


def _model_state(model_sd: Mapping[str, Any]) -> _ModelState:
    keys, joined = _keys_and_joined(model_sd)
    return _ModelState(keys, joined, list(model_sd.values()))


def _same_keys(meta: dict, model_keys: _ModelState) -> bool:
    """Whether the model's keys are the checkpoint's, in its order."""
    theirs, mine = meta.get("keys_joined"), model_keys.joined
    if theirs is not None and mine is not None:
        return theirs == mine  # each splits back into its keys alone, so equal strings are equal keys
    return _checkpoint_keys(meta) == model_keys.keys


def _checkpoint_keys(meta: dict) -> list[str]:
    """The checkpoint's keys (on the wire as one joined string where it can be: _to_wire), split once."""
    if meta["keys"] is None:
        meta["keys"] = meta["keys_joined"].split("\0") if meta["num_keys"] else []
    return meta["keys"]


_PLAIN = (torch.Tensor, nn.Parameter)
#: COALESCED_BCAST_EARLY_DESCRIBE=0: the source describes its tensors after reading the model's state, not beside
#: it (A/B runs).
_EARLY_DESCRIBE = os.environ.get("COALESCED_BCAST_EARLY_DESCRIBE", "1") != "0"


def _start_describe(sd: Any) -> Optional[tuple[list, Any]]:
    """The source's tensors described on a thread (_C.start_describe) while this one reads the model's state, where
    every value is a plain tensor (the usual checkpoint): (the values, the pending description), else None."""
    if not _EARLY_DESCRIBE or not isinstance(sd, Mapping):
        return None
    try:
        values = list(sd.values())
        if not values or not set(map(type, values)) <= set(_PLAIN):
            return None
        return values, _C.start_describe(values)
    except Exception:  # a Mapping that fails to list its values: _describe_source words it, on every rank
        return None


def _describe_source(sd: Optional[Mapping[str, Any]], extra: Mapping[str, nn.Module], device: torch.device,
                     error: Optional[str], bucket_bytes: int, ring_depth: int, rank: int,
                     model_sd: Optional[Mapping[str, Any]] = None,
                     model_keys: _ModelState = _NO_MODEL_STATE, early: Optional[tuple] = None) -> tuple[dict, Any]:
    """The metadata every rank plans from: the keys; for the plain tensors among the values (their key
    indices in `rows`) a C++-made table of dtype, ndim and sizes and, in `canon`, per row the first row that is
    the same tensor (ties are sent once); extra states (`extras`, pickled objects) and refusals (`bad`).
    early: _start_describe(sd)'s, used where no value is a module's extra state."""
    meta: dict[str, Any] = dict(fatal=None, keys=[], num_keys=0, keys_joined=None, rows=None, table=None, canon=None,
                                extras={}, bad={}, bucket_bytes=bucket_bytes, ring_depth=ring_depth, norm_versions={})
    if error is None and not isinstance(sd, Mapping):
        error = f"sd is {'None' if sd is None else 'a ' + type(sd).__name__} on the source; pass the full state dict"
    if error is None:
        error = _check_options(bucket_bytes, ring_depth)
    if error is not None:
        meta["fatal"] = f"rank {rank}: {error}"
        return meta, []
    keys, joined = _keys_and_joined(sd)
    meta["keys"], meta["num_keys"], meta["keys_joined"] = keys, len(keys), joined
    bad_key = None if joined is not None else next((k for k in keys if not isinstance(k, str)), None)
    if bad_key is not None:
        meta["fatal"] = f"rank {rank}: the state dict has a key that is not a string: {bad_key!r}"
        return meta, []
    rows, tensors = [], []
    plain = _PLAIN
    if extra:
        early = None  # described as a whole: some values are extra states
    values = early[0] if early is not None else list(sd.values())
    if early is not None or (not extra and set(map(type, values)) <= set(plain)):  # the usual case: all tensors
        rows, tensors = range(len(values)), values  # (a range: no int object per key)
    else:
        for i, (k, v) in enumerate(sd.items()):
            if k in extra:  # a module's extra state: any picklable object, sent with the metadata
                meta["extras"][i] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
            elif type(v) in plain:
                rows.append(i)
                tensors.append(v)
            else:
                meta["bad"][i] = _source_problem(v)
    # The same keys in order: none lacking; no batch norm's counter among the model's keys: none to fill.
    if (model_sd is not None and (model_keys.joined is None or _NBT in model_keys.joined)
            and not _same_keys(meta, model_keys)):
        meta["norm_versions"] = _norm_versions(sd, model_sd)
    if early is not None:
        table, canon, problems, tensors = early[1].result(device)  # tensors: now a _C.TensorList
    else:
        table, canon, problems, tensors = _C.describe_tensors(tensors, device)
    for j, why in problems:
        meta["bad"][rows[j]] = why
    every = len(rows) == len(keys)  # the usual case: each key a row, in order
    meta["rows"] = torch.arange(len(rows), dtype=torch.int64) if every else torch.tensor(rows, dtype=torch.int64)
    meta["table"] = table
    meta["canon"] = canon  # as table rows
    return meta, tensors


def _norm_versions(sd: Mapping[str, Any], model_sd: Mapping[str, Any]) -> dict[str, Optional[int]]:
    """Per num_batches_tracked key of the model that the checkpoint lacks, the version that the checkpoint's
    _metadata gives its module (None without one): batch norm's own _load_from_state_dict fills the key in
    for checkpoints older than version 2, so that load_state_dict does not call it missing."""
    lacking = [k for k in model_sd if k.endswith(_NBT) and (k == _NBT or k.endswith(_DOT_NBT)) and k not in sd]
    if not lacking:
        return {}
    md = getattr(sd, "_metadata", None)
    return {k: md.get(k[:-len(_NBT)].rstrip("."), {}).get("version") if md is not None else None for k in lacking}


def _torch_fills(model: nn.Module, key: str, versions: Mapping[str, Optional[int]]) -> bool:
    """A missing key that load_state_dict would not report: batch norm's num_batches_tracked in an old checkpoint."""
    if key not in versions or (versions[key] is not None and versions[key] >= 2):
        return False
    try:
        m = model.get_submodule(key[:-len(_NBT)].rstrip("."))
    except AttributeError:
        return False
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats


def _under_none_children(model: nn.Module) -> tuple[str, ...]:
    """Prefixes of children set to None: load_state_dict passes over checkpoint keys under them."""
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        out += [f"{name}.{c}." if name else f"{c}." for c, child in m._modules.items() if child is None]
    return tuple(out)


def _check_options(bucket_bytes: int, ring_depth: int) -> Optional[str]:
    if bucket_bytes < 4096 or bucket_bytes % 16:
        return f"bucket_bytes={bucket_bytes}: it must be a multiple of 16 and at least 4096"
    if ring_depth < 1:
        return f"ring_depth={ring_depth}: it must be at least 1"
    return None


def _broadcast_meta(meta: Optional[dict], pg: dist.ProcessGroup, src_g: int, ctrl: torch.device,
                    rank: int) -> tuple[dict, Optional[str]]:
    """The source's metadata on every rank, and why this rank cannot read it (None: it can). Every rank
    takes part in every broadcast whatever fails, so that a failure reaches the agreement instead of
    leaving the others waiting."""
    if pg.size() == 1:  # the source alone: nothing to send (and nothing to pickle)
        return meta, None
    src = dist.get_global_rank(pg, src_g)
    blob = b""
    if meta is not None:
        try:
            blob = pickle.dumps(_to_wire(meta), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # a module's extra state that cannot be pickled, most likely
            meta = dict(fatal=f"rank {rank}: the checkpoint's metadata (keys, shapes, extra states) cannot be "
                              f"pickled: {type(e).__name__}: {e}")
            blob = pickle.dumps(meta)
    # On the control stream, as the agreement's records: the host waits for these alone, not for what the caller
    # queued before the load (its model's initialization, say).
    with control_stream(ctrl):
        n = torch.tensor([len(blob)], dtype=torch.int64, device=ctrl)
        dist.broadcast(n, src, group=pg)
        total = int(n.item())
        host = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if meta is not None
                else torch.empty(total, dtype=torch.uint8))
        if ctrl.type == "cpu":
            # gloo reads and writes host memory: the bytes go as they lie, in one broadcast (a staging copy in
            # pieces cost 5-8 ms per 512 KiB on the 2-core CI machine, where torch's copy_ ran on two threads).
            if total:
                dist.broadcast(host, src, group=pg)
        else:
            chunk = torch.empty(min(total, _META_CHUNK), dtype=torch.uint8, device=ctrl)
            for lo in range(0, total, _META_CHUNK):
                part = chunk[:min(_META_CHUNK, total - lo)]
                if meta is not None:
                    part.copy_(host[lo:lo + part.numel()])
                dist.broadcast(part, src, group=pg)
                if meta is None:
                    host[lo:lo + part.numel()].copy_(part)
    if meta is not None:
        return meta, None
    try:
        return _from_wire(pickle.loads(memoryview(host.numpy()))), None
    except Exception as e:  # an extra state whose class this process cannot import, say
        return dict(fatal=None), (f"the source's metadata cannot be unpickled on rank {rank}: "
                                  f"{type(e).__name__}: {e}")


_WIRE_TABLES = ("rows", "table", "canon")  # the metadata's int64 tensors


def _to_wire(meta: dict) -> dict:
    """The metadata with its int64 tables as (shape, columns, raw bytes): a pickled tensor goes through torch's
    storage reduction, 3-4x the time of the rest of the metadata at 16k keys; and its keys as one joined string,
    where they can be, not a list. A table goes without its trailing columns of zeros (the size columns past every
    tensor's last dimension: 8 of the 10 where all are 1-dim), a 0, 1, ..., n-1 column (rows, canon without
    ties) as its length alone: for 16k 1-dim tensors 1.57 MB of tables become 0.39 MB (the pickled metadata of
    the bench's 16k-key state 1.66 -> 0.48 MB), bytes that go through device memory in 512 KiB pieces."""
    wire = dict(meta)
    if wire.get("keys_joined") is not None:
        wire["keys"] = None  # the joined string goes instead (_checkpoint_keys)
    for k in _WIRE_TABLES:
        t = wire.get(k)
        if not isinstance(t, torch.Tensor):
            continue
        t = t.contiguous()
        if t.dim() == 1 and t.numel() > 0 and bool(torch.equal(t, torch.arange(t.numel(), dtype=t.dtype))):
            wire[k] = (tuple(t.shape), 0, None)
        elif t.dim() == 2 and t.numel() > 0:
            used = t.ne(0).any(dim=0).nonzero()
            cols = int(used[-1]) + 1 if used.numel() else 0
            wire[k] = (tuple(t.shape), cols, t[:, :cols].contiguous().numpy().tobytes())
        else:
            wire[k] = (tuple(t.shape), -1, t.numpy().tobytes())
    return wire


def _from_wire(wire: dict) -> dict:
    for k in _WIRE_TABLES:
        v = wire.get(k)
        if not isinstance(v, tuple):
            continue
        shape, cols, raw = v
        if raw is None:
            wire[k] = torch.arange(shape[0], dtype=torch.int64)
        elif cols >= 0:
            t = torch.zeros(shape, dtype=torch.int64)
            if cols:
                t[:, :cols] = torch.frombuffer(bytearray(raw), dtype=torch.int64).reshape(shape[0], cols)
            wire[k] = t
        else:
            wire[k] = (torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else
                       torch.empty(0, dtype=torch.int64)).reshape(shape)
    return wire


class _Plan:
    """This rank's share of the load: key matching's outcome and the engine's plan."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.extras: list[tuple[Any, nn.Module]] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.strict_after_hooks = False  # strict is judged after post-hooks that may clear keys
        self.num_keys = 0
        self.cast_keys = 0
        self.digest = 0
        self.tensors = 0  # distinct checkpoint tensors with bytes
        self.total = 0  # their bytes
        self.core = None  # the engine's plan (_C.start_load_plan(...).result())
        self.hooks: Any = None  # a _C.HookJudgment of the post-hooks, begun while the plan was made
        self.prepared: Any = None  # the engine's ring made before the agreement (_prepare), for the transfer
        self.prepacked = 0  # of its buckets, those packed while the source planned (_prepack)
        self.ring_bytes = 0
        self.host_ring_bytes = 0
        self.host_batched_bytes = 0


def _plan_local(model: nn.Module, model_sd: Optional[Mapping[str, Any]], model_keys: _ModelState,
                extra: Mapping[str, nn.Module],
                owned: Any, meta: dict, src_tensors: Any, strict: bool, device: torch.device, rank: int,
                error: Optional[str], bucket_bytes: int, ring_depth: int, copy_threads: Optional[int]) -> _Plan:
    plan = _Plan()
    try:
        if error is not None:
            plan.errors.append(error)
        else:
            _plan_keys(plan, model, model_sd, model_keys, extra, owned, meta, src_tensors, strict, device, rank,
                       bucket_bytes, ring_depth, copy_threads)
    except Exception as e:  # a bug or a refusal of the engine must reach the other ranks, not strand them
        plan.errors.append(f"{type(e).__name__}: {e}")
    if plan.errors:
        plan.errors.insert(0, f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:")
    return plan


def _prepack(meta: dict, src_tensors: Any, device: torch.device, bucket_bytes: int, ring_depth: int,
             rank: int, copy_threads: Optional[int], model_sd: Optional[Mapping[str, Any]],
             model_keys: _ModelState, extra: Mapping[str, nn.Module]) -> Any:
    """The source's first buckets (one per ring slot) read from the checkpoint's host memory into a ring while
    it still plans (csrc/prepack.cpp): on a GPU the copy up the bus is the load's slowest leg, and those buckets'
    copies need only the metadata table, the tensors and the order of the model's keys. A _C.Prepack for
    _prepare, or None: nothing to win (a CPU model, sources on the GPU), a load matched key by key (extra states,
    refused values: _match_keys' loop), or it could not be made (out of memory: the ring made with the plan says
    so in the agreement)."""
    # COALESCED_BCAST_PREPACK=0 (read per load): none (the bench's A/B switch).
    if (not _PREPARE or os.environ.get("COALESCED_BCAST_PREPACK") == "0" or device.type != "cuda"
            or meta.get("table") is None or not isinstance(src_tensors, _C.TensorList) or model_sd is None
            or extra or meta["extras"] or meta["bad"]):
        return None
    try:
        rows = None  # the table's rows as they come
        if not _in_checkpoint_order(meta, model_sd, model_keys):
            rows = _usual_match(meta, model_sd).rows  # shared with _match_keys, which runs next
            if rows is None:
                return None
        return _C.prepack_load(meta["table"], meta["canon"], rows, src_tensors, bucket_bytes, ring_depth, rank,
                               _copy_threads(copy_threads), device)
    except Exception as e:
        logger.debug("load_full_state_dict: no prepack on rank %d: %s", rank, e)
        return None


def _copy_threads(copy_threads: Optional[int]) -> int:
    if copy_threads is None:
        copy_threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return max(1, int(copy_threads))


def _prepare(plan: _Plan, model: nn.Module, is_src: bool, rank: int, bucket_bytes: int, early: Any = None) -> None:
    """The ring before the agreement (csrc/pipeline.h, PreparedRun), as a sync makes it: a rank that cannot have
    it (out of memory) refuses in the agreement, so that every rank raises with nothing written, where after it
    that rank alone would fail while the others wait in the first broadcast; and the source's first buckets are
    read from the checkpoint (host memory: the bus's slowest leg) while the ranks agree, or were read while it
    planned (early: _prepack's, whose ring the run takes where it packed those buckets as this plan does)."""
    core = plan.core
    if core is None or plan.errors or not _PREPARE or not core.can_prepare:
        return
    try:
        plan.prepared = core.prepare(is_src, early=early)
        plan.prepacked = plan.prepared.prepacked
    except Exception as e:  # out of memory, mostly
        plan.errors += [f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:",
                        f"rank {rank} could not make its ring of {core.ring_slots} buckets "
                        f"(bucket_bytes={bucket_bytes}): {type(e).__name__}: {e}"]


def _plan_keys(plan: _Plan, model: nn.Module, model_sd: Mapping[str, Any], model_keys: _ModelState,
               extra: Mapping[str, nn.Module],
               owned: Any, meta: dict,
               src_tensors: Any, strict: bool, device: torch.device, rank: int,
               bucket_bytes: int, ring_depth: int, copy_threads: Optional[int]) -> None:
    if (bucket_bytes, ring_depth) != (meta["bucket_bytes"], meta["ring_depth"]):
        plan.errors.append(f"bucket_bytes={bucket_bytes}, ring_depth={ring_depth} on rank {rank}, but the source "
                           f"uses {meta['bucket_bytes']}, {meta['ring_depth']}; pass the same options everywhere")
        return
    load_keys, values, value_rows, value_keys, extra = _match_keys(plan, model, model_sd, model_keys, extra, meta,
                                                                   strict, rank)
    boxes: dict = {}  # per (mesh, placements, shape) of an n-D mesh: this rank's box, found once

    def mesh_facts(mesh) -> tuple[bool, int, int, int]:
        coord = mesh.get_coordinate()
        one_d = mesh.ndim == 1
        return coord is not None, coord[0] if coord is not None and one_d else 0, mesh.ndim, mesh.size(0) if one_d else 0

    def nd_box(mesh, placements, shape):
        memo = (id(mesh), id(placements), shape)  # ids: hashing placements runs Python per call
        found = boxes.get(memo)
        if found is None:
            found = boxes[memo] = _dtensor_box(mesh, placements, shape)
        return found

    DTensor, Replicate, Shard = _dtensor.classes()
    copy_threads = _copy_threads(copy_threads)
    table = meta["table"]
    # The usual load (every checkpoint tensor a unit of its own, in the model's key order) is planned while
    # load_dests runs, fed its destinations as it finds them (csrc/dest_feed.h); the source's pack runs are made
    # then too. A checkpoint in another order (sorted keys) is fed its table and tensors in the model's order.
    fed = None
    if len(values) == table.size(0) and _feed_plan():
        fed_rows, fed_table, fed_sources = value_rows, table, src_tensors if src_tensors is not None else []
        if value_rows is not meta["rows"]:  # (meta's rows: the table's order, _match_keys' usual case)
            fed_table = table.index_select(0, value_rows)
            if src_tensors is not None:
                fed_sources = src_tensors.take(value_rows)
        fed = _C.start_fed_load_plan(fed_table, fed_sources, len(values), bucket_bytes, ring_depth, rank,
                                     copy_threads, device)
    try:
        local, meta_t, units_t, unit_src_rows, plan.cast_keys, problems = _C.load_dests(
            values, value_rows, table, meta["canon"], owned, DTensor, Shard,
            Replicate, mesh_facts, nd_box, device, rank, _scalar_from_any_1dim(), feed=fed)
    except BaseException:
        if fed is not None:
            fed.close(False)
        raise
    plan.errors += [msg.replace(_C.key_mark, value_keys[i]) for i, msg in problems]
    # Units in model order (ties on a rank are written in load_state_dict's order); the source's tensors
    # in the same order (by table row).
    n = table.size(0)
    in_order = unit_src_rows.numel() == n and bool(torch.equal(unit_src_rows, torch.arange(n)))
    if fed is not None:  # not used where a tensor was named twice (csrc/dest_feed.h)
        fed.close(not plan.errors and unit_src_rows.numel() == n and bool(torch.equal(unit_src_rows, fed_rows)))
    plan.num_keys = len(load_keys)
    plan.digest = _digest(load_keys, extra, model_keys)
    if plan.errors:
        return
    if fed is not None and fed.used:
        pending = fed
    else:
        if fed is not None:
            fed.result()  # (None) its thread done reading the source's tensors, which `take` moves out
            local = fed.dests()  # load_dests put the destinations in the feed alone
        sources = []
        if src_tensors is not None:  # a _C.TensorList on the source (one per table row)
            sources = src_tensors if in_order else src_tensors.take(unit_src_rows)
        pending = _C.start_load_plan(units_t, sources, local, meta_t, bucket_bytes, ring_depth, rank, copy_threads,
                                     device)
    # Meanwhile, whether FSDP2's post-hooks would all do nothing after the in-place writes (the Python objects
    # they read, under the GIL, while the plan is made beside): the writes change no object a hook reads,
    # set_extra_state (plan.extras) may. On a CPU model all of them here; on a GPU until the plan is made, the
    # rest after the transfer is queued (_run_post_hooks), beside the copies: judged here in full, one H200,
    # MoE load of 1,651 keys from pinned memory, median 200.6 ms against 196.0 judged after (16k keys: 85.8
    # either way), while a load from rank 0's GPU, whose copies are short, waited for them after. A fed plan is
    # all but made when load_dests returns: there is no wait to fill, and the judgment's walk of the modules
    # (1-3 ms at 16k hooks) would only hold back the transfer, so on a GPU it is all left to _run_post_hooks.
    after = _judge_hooks_after_transfer(device)
    if not plan.extras and not _run_all_post_hooks() and not (after and pending is fed):
        plan.hooks = _C.HookJudgment(model)
        if after:
            while not pending.done() and plan.hooks.step(_HOOKS_PER_STEP) is None:
                pass
        else:
            plan.hooks.verdict()
    plan.core = pending.result()
    plan.tensors, plan.total = plan.core.num_units_sent, plan.core.total_bytes


def _match_keys(plan: _Plan, model: nn.Module, model_sd: Mapping[str, Any], model_keys: _ModelState,
                extra: Mapping[str, nn.Module], meta: dict, strict: bool,
                rank: int) -> tuple[list[str], list, torch.Tensor, list[str], Mapping]:
    """Key matching, as load_state_dict matches: the keys loaded, their values, each one's table row (int64),
    the keys worded in errors, and the extra-state modules that take a value. Missing, unexpected and
    refused keys go to `plan`."""
    extras, bad = meta["extras"], meta["bad"]
    if not extra and not bad and _in_checkpoint_order(meta, model_sd, model_keys):
        # The usual case: nothing to match key by key.
        return model_keys.keys, model_keys.values, meta["rows"], model_keys.keys, extra
    keys = _checkpoint_keys(meta)
    index, row_of = _key_index(meta)
    if extra:  # load_state_dict takes extra state only into modules that override set_extra_state
        unset = {k for k, m in extra.items() if type(m).set_extra_state is nn.Module.set_extra_state}
        if unset:
            model_sd = {k: v for k, v in model_sd.items() if k not in unset}
            extra = {k: m for k, m in extra.items() if k not in unset}
    # The usual case (no value an extra state or refused) in one pass over the keys (_usual_match); the loop
    # below costs ~3x more per key.
    usual = _usual_match(meta, model_sd) if not extra and not bad else None
    plan.missing = usual.missing if usual is not None else [k for k in model_sd if k not in index]
    if plan.missing and meta.get("norm_versions"):
        plan.missing = [k for k in plan.missing if not _torch_fills(model, k, meta["norm_versions"])]
    # Every checkpoint key matched (keys are unique on both sides): none is unexpected.
    every = usual is not None and len(usual.keys) == len(keys)
    plan.unexpected = [] if every else [k for k in keys if k not in model_sd]
    if plan.unexpected:
        under_none = _under_none_children(model)
        if under_none:
            plan.unexpected = [k for k in plan.unexpected if not k.startswith(under_none)]
    if strict and (plan.missing or plan.unexpected) and _key_editing_hooks(model):
        plan.strict_after_hooks = True  # as load_state_dict: the hooks may clear them
    elif strict:
        plan.errors += _strict_errors(plan.missing, plan.unexpected)
    # Key matching here; per value, its checks, unit and box in C++ (csrc/load_dests.h).
    if usual is not None and usual.rows is not None:  # else a source value is extra state: the loop words it
        values = list(model_sd.values()) if len(usual.keys) == len(model_sd) else [model_sd[k] for k in usual.keys]
        return usual.keys, values, usual.rows, usual.keys, extra
    load_keys, values, value_rows, value_keys = [], [], [], []
    for k, v in model_sd.items():
        i = index.get(k)
        if i is None:
            continue
        load_keys.append(k)
        if k in extra:
            if i not in extras:
                plan.errors.append(f'"{k}": extra state on rank {rank}, but not on the source (models differ)')
            else:
                plan.extras.append((extras[i], extra[k]))
            continue
        if i in bad:
            plan.errors.append(f'While copying the parameter named "{k}", the source\'s value is {bad[i]}.')
            continue
        j = i if row_of is None else row_of.get(i)
        if j is None:
            plan.errors.append(f'"{k}": extra state on the source, but a tensor on rank {rank} (models differ)')
            continue
        values.append(v)
        value_rows.append(j)
        value_keys.append(k)
    return load_keys, values, torch.tensor(value_rows, dtype=torch.int64), value_keys, extra


def _in_checkpoint_order(meta: dict, model_sd: Mapping[str, Any], model_keys: _ModelState) -> bool:
    """Whether the model's keys are the checkpoint's, in its order, each value a tensor of its own table row
    (rows is then 0..n-1)."""
    return meta["rows"].numel() == meta["num_keys"] == len(model_sd) and _same_keys(meta, model_keys)


def _key_index(meta: dict) -> tuple[dict[str, int], Optional[dict[int, int]]]:
    """The checkpoint's key -> key index, and key index -> table row (None where each key is the row of its
    index: no value is an extra state or refused); made once per load (meta keeps them)."""
    found = meta.get("_index")
    if found is None:
        keys = _checkpoint_keys(meta)
        index = dict(zip(keys, range(len(keys))))
        rows = meta["rows"]
        every = rows.numel() == meta["num_keys"]  # (then rows is 0..n-1: _describe_source)
        found = meta["_index"] = index, None if every else dict(zip(rows.tolist(), range(rows.numel())))
    return found


class _UsualMatch(NamedTuple):
    keys: list  # the model's keys found in the checkpoint, in the model's order
    rows: Optional[torch.Tensor]  # their table rows (int64); None where a key's value is an extra state
    missing: list  # the model's keys not in the checkpoint


def _usual_match(meta: dict, model_sd: Mapping[str, Any]) -> _UsualMatch:
    """Key matching where no value is an extra state nor refused, in one pass over the model's keys. Made once
    per load and model state: the source's prepack matches before its plan does."""
    found = meta.get("_usual")
    if found is not None and found[0] is model_sd:
        return found[1]
    index, row_of = _key_index(meta)
    keys = list(model_sd)
    at = array.array("q", map(index.get, keys, itertools.repeat(-1, len(keys))))  # (a list comprehension: ~1.5x)
    if row_of is not None:  # -2: a key whose value has no table row (an extra state)
        at = array.array("q", [-1 if i < 0 else row_of.get(i, -2) for i in at])
    rows = torch.frombuffer(at, dtype=torch.int64) if at else torch.empty(0, dtype=torch.int64)
    if at and bool((rows >= 0).all()):
        match = _UsualMatch(keys, rows, [])
    else:
        found_at = (rows != -1).tolist()
        missing = list(itertools.compress(keys, [not f for f in found_at]))
        rows = rows[rows != -1]
        match = _UsualMatch(list(itertools.compress(keys, found_at)), None if bool((rows < 0).any()) else rows,
                            missing)
    meta["_usual"] = model_sd, match
    return match


def _int64_table(rows: list[list[int]], width: int) -> torch.Tensor:
    """rows as an int64 [len(rows), width] tensor, through one flat buffer (nested lists convert slowly)."""
    flat = array.array("q", itertools.chain.from_iterable(rows))
    return torch.frombuffer(flat, dtype=torch.int64).reshape(len(rows), width) if rows else \
        torch.zeros((0, width), dtype=torch.int64)


_CODES: dict[torch.dtype, int] = {}
#: What the engine casts between (csrc/cast.h: castable()).
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
             torch.int32, torch.int64, torch.bool)


def _dtype_code(dtype: torch.dtype) -> int:
    """c10::ScalarType's number for dtype (what the engine's tables hold)."""
    code = _CODES.get(dtype)
    if code is None:
        code = _CODES[dtype] = _C.scalar_type_code(dtype)
    return code


def _dtype_of_code(code: int) -> torch.dtype:
    """The dtype whose c10::ScalarType number is `code` (_dtype_code's inverse)."""
    if not _DTYPES:  # every dtype torch names, once
        for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                _DTYPES[_dtype_code(d)] = d
            except (TypeError, RuntimeError):  # a dtype this torch names but cannot convert
                pass
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise ValueError(f"no torch dtype has scalar type number {code}")
    return dtype


_DTYPES: dict[int, torch.dtype] = {}


def _strict_errors(missing: list[str], unexpected: list[str]) -> list[str]:
    out = []
    if missing:
        out.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        out.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    return out


def _key_editing_hooks(model: nn.Module) -> bool:
    """Whether a load_state_dict post-hook that may edit the missing or unexpected keys is registered:
    any but FSDP's own, which re-pad shards and leave the keys alone."""
    return any(not (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")
               for m in model.modules() for hook in m._load_state_dict_post_hooks.values())


@functools.lru_cache(maxsize=None)
def _scalar_from_any_1dim() -> bool:
    """Whether this torch's load_state_dict puts the first element of a 1-dim value of any length into a 0-dim
    tensor (its rule for torch 0.3 checkpoints; later versions take a value of one element only)."""
    m = nn.Module()
    m.register_buffer("x", torch.zeros(()))
    try:
        m.load_state_dict({"x": torch.ones(2)})
    except RuntimeError:
        return False
    return True


def _dtensor_box(mesh, placements, shape: tuple[int, ...]):
    """(problem, the global offset of this rank's box or None if it holds none, the box's shape), for a
    DTensor on a mesh of other than one dim or one this rank is not in (load_dests does 1-D meshes)."""
    _, Replicate, Shard = _dtensor.classes()
    bad = [p for p in placements if type(p) is not Shard and type(p) is not Replicate]
    if bad:
        return f"placement {bad[0]} is not supported (only Shard(dim) and Replicate)", None, None
    if mesh.get_coordinate() is None:
        return None, None, None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    lshape, off = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return None, tuple(off), tuple(lshape)


def _digest(load_keys: list[str], extra: Mapping[str, nn.Module],
            model_keys: _ModelState = _NO_MODEL_STATE) -> int:
    h = hashlib.blake2b(digest_size=8)  # each key, then 1 if it holds extra state else 0: one update
    if extra:
        h.update("".join(k + ("\1" if k in extra else "\0") for k in load_keys).encode())
    elif load_keys is model_keys.keys and model_keys.joined is not None and load_keys:  # every key of the model
        h.update((model_keys.joined + "\0").encode())
    elif load_keys:
        h.update(("\0".join(load_keys) + "\0").encode())
    return int.from_bytes(h.digest(), "little", signed=True)


_REFUSED, _AFTER_HOOKS = 1, 2  # a record's status, beside 0: ready


def _gather_records(status: int, digest: int, n: int, msg: str, pg: dist.ProcessGroup,
                    ctrl: torch.device) -> tuple[list[list[int]], Callable[[int], str]]:
    """One all_gather of a small record per rank: the heads [status, digest, n] and each rank's message.

    On the control stream (agree.control_stream: high priority, its own): the host then waits for the records
    alone, not for the caller's work or the source's first packs queued before the agreement (_prepare)."""
    if pg.size() == 1:  # nothing to gather: this rank's own record
        return [[status, digest, n]], lambda r: msg
    rec = torch.zeros(_RECORD, dtype=torch.uint8)
    rec[:24].view(torch.int64).copy_(torch.tensor([status, digest, n]))
    raw = msg.encode()[: _RECORD - 24]
    if raw:
        rec[24:24 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with control_stream(ctrl):
        out = [torch.empty(_RECORD, dtype=torch.uint8, device=ctrl) for _ in range(pg.size())]
        dist.all_gather(out, rec.to(ctrl), group=pg)
        table = torch.stack(out).cpu()

    def text(r: int) -> str:
        words = bytes(table[r, 24:].tolist()).rstrip(b"\0").decode(errors="replace")
        return words + (" [...]" if len(words.encode()) >= _RECORD - 24 - 4 else "")
    return table[:, :24].contiguous().view(torch.int64).tolist(), text


def _agree(plan: _Plan, pg: dist.ProcessGroup, src_g: int, ctrl: torch.device, rank: int) -> bool:
    """Every rank raises the same verdict, before any write. Returns whether some rank judges strict only
    after the post-hooks (then every rank takes part in that verdict: _strict_after_hooks)."""
    msg = "\n\t".join(plan.errors)
    status = _REFUSED if msg else _AFTER_HOOKS if plan.strict_after_hooks else 0
    heads, text = _gather_records(status, plan.digest, plan.num_keys, msg, pg, ctrl)
    ranks = dist.get_process_group_ranks(pg)
    if msg:
        raise LoadStateDictError(f"load_full_state_dict: no rank loaded anything. {msg}")
    for r, (status, digest, n) in enumerate(heads):
        if status == _REFUSED:
            raise LoadStateDictError(f"load_full_state_dict: rank {ranks[r]} refused, so no rank loaded anything. "
                                     f"{text(r)}")
    src_digest, src_n = heads[src_g][1], heads[src_g][2]
    for r, (_, digest, n) in enumerate(heads):
        if (digest, n) != (src_digest, src_n):
            raise LoadStateDictError(
                f"load_full_state_dict: rank {ranks[r]} would load {n} keys of the checkpoint and source rank "
                f"{ranks[src_g]} {src_n} (or the same number of different keys): the models differ, so no rank "
                f"loaded anything")
    return any(head[0] == _AFTER_HOOKS for head in heads)


def _strict_after_hooks(plan: _Plan, model: nn.Module, strict: bool, pg: dist.ProcessGroup, ctrl: torch.device,
                        rank: int, hook_error: Optional[BaseException]) -> None:
    """strict, judged on the keys the post-hooks left, as load_state_dict judges it: every rank raises the
    same verdict (the tensors are written by then, as load_state_dict has written them when it raises), also
    where a rank's set_extra_state or post-hook raised."""
    errors = _strict_errors(plan.missing, plan.unexpected) if strict else []
    if hook_error is not None:
        errors = [f"{type(hook_error).__name__} from set_extra_state or a post-hook: {hook_error}"]
    msg = ""
    if errors:
        msg = "\n\t".join([f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:"] + errors)
    heads, text = _gather_records(_REFUSED if msg else 0, 0, 0, msg, pg, ctrl)
    ranks = dist.get_process_group_ranks(pg)
    for r, head in enumerate(heads):
        if head[0] == _REFUSED:
            raise LoadStateDictError(f"load_full_state_dict: the tensors were loaded, but after the load's post-hooks "
                                     f"rank {ranks[r]} still has: {text(r)}") from hook_error


# ---------------------------------------------------------------------------------------------------
# Transfer: the engine's plan, bucket by bucket through its ring.


def _transfer(plan: _Plan, pg: dist.ProcessGroup, src_g: int, is_src: bool, timeout: Optional[timedelta],
              progress_seconds: float, t0: float) -> tuple[int, Any]:
    """Buckets sent, and the source's copies of host memory still running (None when none are)."""
    core = plan.core
    if core is None or core.num_buckets == 0:
        return 0, None
    total = plan.total

    def progress(done: int) -> None:  # the source only, from inside the transfer
        now = time.perf_counter()
        rate = done / max(now - t0, 1e-9)
        logger.info("load_full_state_dict: %.2f of %.2f GiB queued (%.0f%%), %.2f GB/s, ETA %.0f s", done / 2**30,
                    total / 2**30, 100 * done / total, rate / 1e9, (total - done) / rate if rate else 0.0)

    # COALESCED_BCAST_LOAD_HOST_WAIT=inline: the host waits for the copies inside the broadcast (the bench's A/B).
    leave = os.environ.get("COALESCED_BCAST_LOAD_HOST_WAIT") != "inline"
    # Taken by the transfer; let go after it either way: it refers to the plan, which the post-hooks must be free
    # to let go (load_full_state_dict), and on an error its ring goes now, not with the traceback.
    prepared, plan.prepared = plan.prepared, None
    try:
        out = payload_broadcast(core, pg, src_g, timeout, progress if is_src else None, progress_seconds,
                                leave_host_reads=leave, prepared=prepared)
    finally:
        prepared = None
    plan.ring_bytes, plan.host_ring_bytes, plan.host_batched_bytes = out[1], out[2], out[3]
    return core.num_buckets, out[4] if leave else None


def _feed_plan() -> bool:
    # COALESCED_BCAST_LOAD_FEED=0: the plan made after load_dests only (the bench's A/B switch).
    return os.environ.get("COALESCED_BCAST_LOAD_FEED") != "0"


def _judge_hooks_after_transfer(device: torch.device) -> bool:
    # COALESCED_BCAST_LOAD_HOOKS_JUDGED=plan|transfer: where (the bench's A/B switch).
    where = os.environ.get("COALESCED_BCAST_LOAD_HOOKS_JUDGED")
    return where == "transfer" if where in ("plan", "transfer") else device.type == "cuda"


_HOOKS_PER_STEP = 256  # post-hooks judged between looks at whether the plan is made (~0.2 ms on one H200)


def _run_all_post_hooks() -> bool:
    return os.environ.get("COALESCED_BCAST_RUN_ALL_POST_HOOKS") == "1"  # the bench's A/B switch


def _run_post_hooks(model: nn.Module, missing: list[str], unexpected: list[str], judgment: Any = None) -> None:
    """load_state_dict's post-hooks, in its order (children first), but for FSDP2's that would do nothing
    after the in-place writes (csrc/post_hooks.h). Where every hook is such, none runs (one C++ walk);
    else each is judged when its turn comes (an earlier hook may have replaced its parameter). judgment: that
    walk, begun while the plan was made (_plan_keys), so that it does not run twice."""
    from torch.nn.modules.module import _IncompatibleKeys
    run_all = _run_all_post_hooks()
    if judgment is not None:
        all_idle = judgment.verdict()
    else:  # not begun while planning (or set_extra_state ran since)
        all_idle = not run_all and _C.post_hooks_idle(model)
    if all_idle:
        return

    def visit(m: nn.Module) -> None:
        for child in m._modules.values():
            if child is not None:
                visit(child)
        hooks = m._load_state_dict_post_hooks
        if hooks:
            keys = _IncompatibleKeys(missing, unexpected)
            for hook in hooks.values():
                if run_all or not _C.idle_fsdp_hook(m, hook):
                    hook(m, keys)

    visit(model)


#: Whether `hook`, registered on a module, is FSDP2's and would do nothing after an in-place load.
_idle_fsdp_hook = _C.idle_fsdp_hook

"""The source's description of its checkpoint for load_full_state_dict (keys, a table of dtypes and shapes,
which keys share a tensor, extra states, refused values), and its broadcast to every rank in a compact wire
format."""
from __future__ import annotations

import pickle
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C, _dtensor
from ._load_keys import _NBT, _NO_MODEL_STATE, _keys_and_joined, _ModelState, _norm_versions, _same_keys
from .agree import broadcast_bytes

_PLAIN = (torch.Tensor, nn.Parameter)


def _start_describe(sd: Any) -> Optional[tuple[list, Any]]:
    """The source's tensors described on a thread (_C.start_describe) while this one reads the model's state, where
    every value is a plain tensor (the usual checkpoint): (the values, the pending description), else None."""
    if not isinstance(sd, Mapping):
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


def _source_problem(v: Any) -> str:
    """Why a value that is not a plain tensor cannot be sent (plain tensors are checked in C++)."""
    if not isinstance(v, torch.Tensor):
        return f"a {type(v).__name__}, not a tensor"
    if isinstance(v, _dtensor.classes()[0]):
        return "a DTensor: the source must hold a full state dict of plain tensors"
    return f"a tensor subclass ({type(v).__name__}), not a plain tensor"


def _check_options(bucket_bytes: int, ring_depth: int) -> Optional[str]:
    if bucket_bytes < 4096 or bucket_bytes % 16:
        return f"bucket_bytes={bucket_bytes}: it must be a multiple of 16 and at least 4096"
    if ring_depth < 1:
        return f"ring_depth={ring_depth}: it must be at least 1"
    return None


def _broadcast_meta(meta: Optional[dict], pg: dist.ProcessGroup, src_g: int, rank: int) -> tuple[dict, Optional[str]]:
    """The source's metadata on every rank (agree.broadcast_bytes), and why this rank cannot read it (None: it
    can). Every rank takes part in every broadcast whatever fails, so that a failure reaches the agreement
    instead of leaving the others waiting."""
    if pg.size() == 1:  # the source alone: nothing to send (and nothing to pickle)
        return meta, None
    blob = None
    if meta is not None:
        try:
            blob = pickle.dumps(_to_wire(meta), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # a module's extra state that cannot be pickled, most likely
            meta = dict(fatal=f"rank {rank}: the checkpoint's metadata (keys, shapes, extra states) cannot be "
                              f"pickled: {type(e).__name__}: {e}")
            blob = pickle.dumps(meta)
    got = broadcast_bytes(blob, pg, src_g, what="the load's metadata broadcast")
    if meta is not None:
        return meta, None
    try:
        return _from_wire(pickle.loads(got)), None
    except Exception as e:  # an extra state whose class this process cannot import, say
        return dict(fatal=None), (f"the source's metadata cannot be unpickled on rank {rank}: "
                                  f"{type(e).__name__}: {e}")


_WIRE_TABLES = ("rows", "table", "canon")  # the metadata's int64 tensors


def _to_wire(meta: dict) -> dict:
    """The metadata with its int64 tables as (shape, columns, raw bytes), and its keys as one joined string where
    they can be, not a list: a pickled tensor goes through torch's storage reduction, which costs more than the
    rest of the metadata, and a list of keys a Python step per key. A table goes without its trailing columns of
    zeros (the size columns past every tensor's last dimension), a 0, 1, ..., n-1 column (rows, canon without
    ties) as its length alone: fewer bytes to go through device memory in agree.META_CHUNK pieces."""
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
    """_to_wire's inverse: the tables as int64 tensors again (the keys stay joined until _checkpoint_keys)."""
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

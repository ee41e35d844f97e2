"""Private helpers that the front-ends (sync, load, refit, install) share: garbage collection paused for a
call, group and source resolution, a module's parameter and buffer slots, dtype codes and int64 tables.
Front-ends import these from here, never from each other."""
from __future__ import annotations

import array
import functools
import gc
import itertools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C


def gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused, and restored afterwards.

    A call over many tensors allocates enough small objects to trigger collections, and each one
    walks every object the process tracks (the model's parameters among them), which costs more than
    the call's own work. What the call frees is freed by reference counting anyway.
    """
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


def _resolve_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("coalesced_bcast needs torch.distributed to be initialized (init_process_group)")
    return group if group is not None else dist.group.WORLD


def _group_src(pg: dist.ProcessGroup, src: int) -> int:
    """`src` is a global rank, as everywhere in torch.distributed; the core wants the group rank."""
    ranks = dist.get_process_group_ranks(pg)
    if src not in ranks:
        raise ValueError(
            f"src={src} is not a rank of the group (its global ranks: {ranks[:16]}{'...' if len(ranks) > 16 else ''}),"
            f" on rank {dist.get_rank()}")
    return ranks.index(src)


def module_states(module: nn.Module, include_buffers: bool = True) -> tuple[list[str], list[torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too), tied names kept, in registration order."""
    named = list(module.named_parameters(remove_duplicate=False))
    if include_buffers:
        named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    return [n for n, _ in named], [t for _, t in named]


def _module_slots(module: nn.Module, include_buffers: bool, *, dedupe: bool = False,
                  names: Optional[list] = None) -> tuple[list[dict], list[str], list[torch.Tensor]]:
    """The dicts that hold them, their keys and the tensors, for every parameter and buffer, in
    module_states' order: a kept plan checks each dict still holds the same object. Tied names are
    kept unless ``dedupe`` (then as named_parameters(): each module and tensor once). ``names``: a list
    to append each dotted name to, for callers that want names up front rather than on an error."""
    if names is None:
        found = _C.module_slots(module, include_buffers, dedupe)  # one C++ pass; None: state not in dicts
        if found is not None:
            return found
    owners: list = []
    keys: list = []
    tensors: list = []
    seen: set = set()
    for attr in ("_parameters", "_buffers") if include_buffers else ("_parameters",):
        for prefix, m in module.named_modules(remove_duplicate=dedupe):
            d = getattr(m, attr)
            for k, t in d.items():
                if t is None or (dedupe and id(t) in seen):
                    continue
                if dedupe:
                    seen.add(id(t))
                if names is not None:
                    names.append(f"{prefix}.{k}" if prefix else k)
                owners.append(d)
                keys.append(k)
                tensors.append(t)
    return owners, keys, tensors


def _int64_table(rows: list[list[int]], width: int) -> torch.Tensor:
    """rows as an int64 [len(rows), width] tensor, through one flat buffer (nested lists convert slowly)."""
    flat = array.array("q", itertools.chain.from_iterable(rows))
    return torch.frombuffer(flat, dtype=torch.int64).reshape(len(rows), width) if rows else \
        torch.zeros((0, width), dtype=torch.int64)


_CODES: dict[torch.dtype, int] = {}
_DTYPES: dict[int, torch.dtype] = {}
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

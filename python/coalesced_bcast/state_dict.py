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

The load's phases live in private modules by concern: _load_checks (the model's modules walked, load logic
of its own judged, the device), _load_source (the source's description and its broadcast), _load_keys (key
matching as load_state_dict matches), _load_plan (the plan, the ring, the transfer, the post-hooks) and
_load_agree (one verdict for every rank).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C
from .agree import host_reads_wait
from .sync import DEFAULT_RING_DEPTH, _group_src, _resolve_group, gc_paused

logger = logging.getLogger(__name__)


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
    host_batched_bytes: int = 0


#: A load's ring slot. Half a sync's: every byte of a load goes through the ring (each rank writes its own
#: shards out of it), so its ring is always allocated whole, and larger buckets do not load faster.
DEFAULT_LOAD_BUCKET_BYTES: int = 64 << 20

# The private modules come after LoadStateDictError, which _load_agree raises. _EXTRA, _walk_modules,
# _from_wire and _to_wire are imported from here by tests too.
from ._load_agree import _agree, _strict_after_hooks  # noqa: E402
from ._load_checks import _check_load_logic, _control_device, _model_device, _walk_modules  # noqa: E402
from ._load_keys import _EXTRA, _NO_MODEL_STATE, _model_state, _ModelState  # noqa: E402,F401
from ._load_plan import _Plan, _plan_load, _run_post_hooks, _transfer  # noqa: E402
from ._load_source import _broadcast_meta, _describe_source, _from_wire, _start_describe, _to_wire  # noqa: E402,F401


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
    pg, src_g, rank, is_src, ctrl, timeout = _arguments(group, src, timeout)
    early = _start_describe(sd) if is_src else None  # the source's tensors described while the model's state is read
    with torch.no_grad():
        state = _read_model(model, sd, strict, is_src, skip_custom_load_logic, pg, ctrl)
        meta, src_tensors = _describe(sd, state, early, bucket_bytes, ring_depth, rank) if is_src else (None, None)
        early = None
        meta, unreadable = _broadcast_meta(meta, pg, src_g, rank)
        if meta["fatal"]:
            raise LoadStateDictError(f"load_full_state_dict: source rank {src} refused, so no rank loaded "
                                     f"anything: {meta['fatal']}")
        plan = _plan_load(model, state.model_sd, state.keys, state.extra, state.owned, meta, src_tensors, strict,
                          state.device, is_src, rank, state.error or unreadable, bucket_bytes, ring_depth, copy_threads)
        try:
            strict_after_hooks = _agree(plan, pg, src_g)
        except BaseException:
            plan.prepared = None  # its ring freed now, not when the traceback goes
            raise
        buckets, reads = _transfer(plan, pg, src_g, is_src, timeout, progress_seconds, t0)
        state = src_tensors = None  # FSDP2's post-hooks may re-pad shards: the load lets go of the tensors
        _after_transfer(plan, model, strict, strict_after_hooks, pg, ctrl, rank, reads, timeout)
    return _stats(plan, buckets, is_src, t0)


def _arguments(group: Optional[dist.ProcessGroup], src: int, timeout: Optional[Union[float, timedelta]]
               ) -> tuple[dist.ProcessGroup, int, int, bool, torch.device, Optional[timedelta]]:
    """The group, the source's rank in it, this rank's global rank, whether it is the source, the device of the
    group's small messages, and the timeout as a timedelta."""
    pg = _resolve_group(group)
    src_g = _group_src(pg, src)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    return pg, src_g, dist.get_rank(), pg.rank() == src_g, _control_device(pg), timeout


class _ModelRead(NamedTuple):
    """What the load read of the model before it plans (_read_model)."""
    model_sd: Optional[Mapping[str, Any]]  # state_dict(keep_vars=True)
    keys: _ModelState
    extra: dict  # state-dict key -> the module whose extra state it holds
    owned: Any  # a _C.IdSet of the model's own parameters and buffers
    device: torch.device  # what the load writes through
    error: Optional[str]  # why this rank cannot load, for the agreement


def _read_model(model: nn.Module, sd: Any, strict: bool, is_src: bool, skip_custom_load_logic: bool,
                pg: dist.ProcessGroup, ctrl: torch.device) -> _ModelRead:
    """The model's state (state_dict(): FSDP2's pre-hook reshards first), its modules walked, their load logic
    judged and the device it loads through. An error is kept for the agreement, so that no rank is left waiting."""
    model_sd, model_keys, extra, owned = None, _NO_MODEL_STATE, {}, _C.IdSet(())
    try:
        model_sd = model.state_dict(keep_vars=True)
        model_keys = _model_state(model_sd)
        extra, owned, custom = _walk_modules(model)
        if custom and not skip_custom_load_logic:
            _check_load_logic(custom, sd, strict, is_src)
        return _ModelRead(model_sd, model_keys, extra, owned, _model_device(model_sd, model_keys, extra, pg), None)
    except Exception as e:
        return _ModelRead(model_sd, model_keys, extra, owned, ctrl, f"{type(e).__name__}: {e}")


def _describe(sd: Any, state: _ModelRead, early: Any, bucket_bytes: int, ring_depth: int,
              rank: int) -> tuple[dict, Any]:
    """On the source: the metadata every rank plans from and the source's tensors (_describe_source); a failure
    worded as the metadata's `fatal`, since the others already wait for it."""
    try:
        return _describe_source(sd, state.extra, state.device, state.error, bucket_bytes, ring_depth, rank,
                                state.model_sd, state.keys, early)
    except Exception as e:
        return dict(fatal=f"rank {rank}: {type(e).__name__}: {e}"), None


def _after_transfer(plan: _Plan, model: nn.Module, strict: bool, strict_after_hooks: bool, pg: dist.ProcessGroup,
                    ctrl: torch.device, rank: int, reads: Any, timeout: Optional[timedelta]) -> None:
    """Extra states set and the post-hooks run, then strict judged where it waits for them; the host does this
    while the source's copies of host memory (reads) may still run, and waits for those before it returns."""
    try:
        plan.direct_buckets = plan.core.direct_buckets if plan.core is not None else 0
        plan.core = None  # FSDP2's post-hook may re-pad shards: let the engine's references go
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
            _strict_after_hooks(plan, model, strict, pg, rank, hook_error)
    finally:
        if reads is not None:  # the caller may free or change the source's tensors once this returns
            host_reads_wait(reads, pg, timeout)


def _stats(plan: _Plan, buckets: int, is_src: bool, t0: float) -> LoadStats:
    stats = LoadStats(
        keys=plan.num_keys, tensors=plan.tensors, bytes=plan.total, buckets=buckets,
        cast_keys=plan.cast_keys, missing_keys=tuple(plan.missing), unexpected_keys=tuple(plan.unexpected),
        ring_bytes=plan.ring_bytes, host_ring_bytes=plan.host_ring_bytes, seconds=time.perf_counter() - t0,
        direct_buckets=plan.direct_buckets, prepacked_buckets=plan.prepacked,
        host_batched_bytes=plan.host_batched_bytes)
    if is_src:
        logger.info("load_full_state_dict: loaded %d keys (%d tensors, %.3f GiB, %d buckets, %d cast) in %.3f s, "
                    "%.2f GB/s", stats.keys, stats.tensors, stats.bytes / 2**30, stats.buckets, stats.cast_keys,
                    stats.seconds, stats.bytes / max(stats.seconds, 1e-9) / 1e9)
    return stats

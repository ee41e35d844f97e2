"""broadcast_tensors and sync_module: plan locally, agree across ranks, then broadcast through the C++ core."""
from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C
from .agree import as_timedelta, check_agreement, group_timeout, payload_broadcast, wait_event
from .verify import verify_plan

logger = logging.getLogger(__name__)

#: Bytes per ring slot. Large enough that a bucket's broadcast runs near link speed on NVLink,
#: small enough that the whole ring (x ring depth) stays far below a layer's size.
DEFAULT_BUCKET_BYTES = 32 << 20
#: Ring slots: one being packed or unpacked while another is on the wire, plus one of slack.
DEFAULT_RING_DEPTH = 3
#: Contiguous tensors of at least this many bytes are broadcast where they are: no copy, no bucket.
DEFAULT_INPLACE_MIN_BYTES = 4 << 20
#: In-place broadcasts are issued in NCCL groups (start/endCoalescing) of about this many bytes.
DEFAULT_COALESCE_BYTES = 1 << 30
#: A call with at most this many smaller tensors sends them in place too, in the same NCCL group: an
#: FSDP unit's two norms cost less that way than a ring (allocation, copy table, events, two kernels).
DEFAULT_SMALL_INPLACE_MAX = 8


@dataclass(frozen=True)
class SyncStats:
    """What one sync did; every rank gets the same counts (seconds are local)."""

    tensors: int  # tensors passed in, aliases and tied names included
    unique_tensors: int  # distinct memory regions sent (tied weights count once)
    bytes: int  # bytes sent, over the unique tensors
    inplace_tensors: int  # tensors broadcast where they live, with no copy
    packed_bytes: int  # bytes that went through buckets
    buckets: int
    ring_bytes: int  # device (or host, on CPU) bytes held for the ring during the call
    seconds: float  # host wall time of the whole call; CUDA work is ordered on the caller's stream
    plan_seconds: float = 0.0  # of which: planning (dedup, checks, bucket layout)
    agree_seconds: float = 0.0  # the cross-rank agreement
    agree_wait_seconds: float = 0.0  # of which waiting for other ranks to arrive (store agreement only)
    enqueue_seconds: float = 0.0  # queueing the broadcasts (on CPU/gloo: running them)
    # tensors this rank could send in place but sent through buckets, as another rank could not
    # (a non-contiguous or unaligned copy there): routes must pair up across ranks
    rerouted: int = 0
    inplace_ops: int = 0  # broadcasts the in-place tensors took: tensors back to back in one buffer share one


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


class _Names(Sequence[str]):
    """Names from a callable, called the first time one is needed: to word an error."""

    def __init__(self, make: Callable[[], Sequence[str]]):
        self._make, self._names = make, None

    def _get(self) -> list[str]:
        if self._names is None:
            self._names = list(self._make())
        return self._names

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):
        return self._get()[i]


def _check_types(tensors: list, names: Sequence[str], rank: int) -> None:
    """Name the first non-tensor (pybind's own message names none)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            label = f" ('{names[i]}')" if i < len(names) else ""
            raise TypeError(f"tensor {i}{label} on rank {rank} is a {type(t).__name__}, not a torch.Tensor")


def gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused, and restored afterwards.

    A call over many tensors allocates enough small objects to trigger collections, and each one
    walks every object the process tracks (the model's parameters among them): on the CPU machine
    they were half the time of a 16k-tensor load_full_state_dict (1.8 -> 0.9 s) and a quarter of
    broadcast_tensors' planning. What the call frees is freed by reference counting anyway.
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


@gc_paused
def broadcast_tensors(
    tensors: Iterable[torch.Tensor],
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    names: Union[Sequence[str], Callable[[], Sequence[str]], None] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ring_depth: int = DEFAULT_RING_DEPTH,
    inplace_min_bytes: int = DEFAULT_INPLACE_MIN_BYTES,
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
    small_inplace_max: int = DEFAULT_SMALL_INPLACE_MAX,
    timeout: Optional[Union[float, timedelta]] = None,
    verify: bool = False,
) -> SyncStats:
    """Make every rank's ``tensors`` bitwise equal to the source rank's, in place.

    Args:
        tensors: dense tensors, all on one device (cpu over gloo, cuda over NCCL). Aliases of the same
            memory (tied weights) are sent once; different views that overlap are refused.
        src: the source's global rank.
        group: the process group (default: the world).
        names: one name per tensor, used in error messages; or a callable returning them, called only
            when an error needs them (naming costs a walk over the module, per call).
        bucket_bytes: bytes per ring slot (multiple of 16, >= 4096). Tensors below ``inplace_min_bytes``
            are packed back to back into buckets of this size; a tensor larger than a bucket is split.
        ring_depth: slots in the ring; extra device memory is at most ``bucket_bytes * ring_depth`` plus
            the copy table, whatever the model's size.
        inplace_min_bytes: contiguous tensors this large are broadcast in place, without a copy.
        coalesce_bytes: in-place broadcasts are grouped into one NCCL group up to this many bytes
            (0: one at a time).
        small_inplace_max: when at most this many tensors are below ``inplace_min_bytes``, they are
            broadcast in place too (no ring): a few tiny broadcasts in one NCCL group cost less.
        timeout: seconds (or a timedelta) for each collective, the agreement's too; default: the group's
            timeout. On NCCL it becomes the group's timeout for the length of the call, and the call also
            waits on the host for its transfer to finish, so that a rank that stalls raises
            CollectiveError here within ``timeout`` (without it, the call returns once the transfer
            is queued and a stall is left to torch's NCCL watchdog).
        verify: after the sync, hash every tensor on every rank and compare (one 32-byte all_reduce);
            raise VerifyError on every rank, naming the first differing tensor, if any rank differs.

    Every rank must call this with tensors of the same structure (checked before any byte moves).
    On CUDA the work is queued on side streams and the caller's current stream is made to wait for
    it (a call with nothing to pack broadcasts on the caller's stream itself): the tensors can be used
    at once, in stream order, without a synchronize.
    """
    t0 = time.perf_counter()
    pg = _resolve_group(group)
    rank = dist.get_rank()
    tensors = list(tensors)
    names = _Names(names) if callable(names) else list(names) if names is not None else []
    plan, error, src_group, rerouted = None, None, None, 0
    try:
        src_group = _group_src(pg, src)  # a bad src on any rank: every rank raises, at the agreement
        # The core writes raw storage with autograd off: parameters go in as they are (no detach(),
        # which would cost a Python object per tensor: at 16k tensors, more than the broadcast).
        def make_plan(names_now: list):
            return _C.Plan(tensors, names_now, bucket_bytes, ring_depth, inplace_min_bytes, coalesce_bytes, rank,
                           small_inplace_max)
        try:
            try:
                plan = make_plan([] if isinstance(names, _Names) else names)
            except ValueError:
                if not isinstance(names, _Names):
                    raise
                plan = make_plan(list(names))  # raises again, naming the tensor
        except TypeError:
            _check_types(tensors, names, rank)
            raise
    except (TypeError, ValueError) as e:
        error = e
    t_planned = time.perf_counter()
    if timeout is not None and isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    with group_timeout(pg, timeout):
        timing: dict = {}
        allowed = check_agreement(plan, error, pg, src_group, names, timeout=timeout,
                                  device=tensors[0].device if tensors and error is None else None, timing=timing)
        if allowed is not None:
            inplace = plan.num_inplace
            plan.restrict_routes(allowed)
            rerouted = inplace - plan.num_inplace
            logger.debug("coalesced_bcast: %d tensors go through buckets on every rank, as some rank cannot send "
                         "them in place", rerouted)
        t_agreed, t_sent = time.perf_counter(), time.monotonic()
        enqueue_seconds, ring_bytes = payload_broadcast(plan, pg, src_group, timeout)
        if timeout is not None and tensors and tensors[0].device.type == "cuda":
            # The transfer is queued, not done: wait for it, so that a source that stalls after the
            # agreement is an error here within `timeout` rather than a stuck stream.
            done = torch.cuda.Event()
            done.record()
            wait_event(done, "the payload broadcast", pg, as_timedelta(timeout), t_sent)
        if verify:
            verify_plan(plan, tensors, names, pg, src_group, timeout)
    stats = SyncStats(
        tensors=plan.num_inputs, unique_tensors=plan.num_unique, bytes=plan.total_bytes,
        inplace_tensors=plan.num_inplace, packed_bytes=plan.packed_bytes, buckets=plan.num_buckets,
        ring_bytes=ring_bytes, seconds=time.perf_counter() - t0, plan_seconds=t_planned - t0,
        agree_seconds=t_agreed - t_planned, enqueue_seconds=enqueue_seconds, rerouted=rerouted,
        inplace_ops=plan.inplace_ops, agree_wait_seconds=timing.get("wait_seconds", 0.0))
    if rank == src:
        logger.info("coalesced_bcast: sent %d tensors (%d unique, %.3f GiB, %d in place, %d buckets) in %.3f s",
                    stats.tensors, stats.unique_tensors, stats.bytes / 2**30, stats.inplace_tensors, stats.buckets,
                    stats.seconds)
    return stats


def module_states(module: nn.Module, include_buffers: bool = True) -> tuple[list[str], list[torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too), tied names kept, in registration order."""
    named = list(module.named_parameters(remove_duplicate=False))
    if include_buffers:
        named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    return [n for n, _ in named], [t for _, t in named]


def sync_module(
    module: nn.Module,
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    include_buffers: bool = True,
    **options,
) -> SyncStats:
    """Make ``module``'s parameters (and buffers, unless ``include_buffers=False``) equal to the source's.

    Takes the options of :func:`broadcast_tensors`; errors name tensors by their module path.
    """
    names, tensors = module_states(module, include_buffers)
    return broadcast_tensors(tensors, src, group, names=names, **options)

"""broadcast_tensors and sync_module: plan locally, agree across ranks, then broadcast through the C++ core."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C
from ._collectives import as_timedelta, group_timeout, payload_broadcast, speculate, wait_device
from ._util import _group_src, _module_slots, _resolve_group, gc_paused, module_states  # noqa: F401 (re-exported)
from .agree import check_agreement
from .verify import verify_plan

logger = logging.getLogger(__name__)

# The defaults live in the C++ core (csrc/plan.h), which the perf binary shares.
#: Bytes per ring slot. Large enough that a bucket's broadcast runs near link speed on NVLink and its
#: fixed costs (an NCCL launch, two events, a copy kernel's start, the host's enqueue) are small beside
#: it, small enough that the whole ring (x ring depth) stays far below a layer's size. The ring is only
#: as large as the bytes that go through it: a state of large tensors (broadcast in place) or a few
#: small ones never allocates it whole. Measurements: bench/results.
DEFAULT_BUCKET_BYTES: int = _C.defaults["bucket_bytes"]
#: Ring slots: one being packed or unpacked while another is on the wire. A bucket's copy takes a
#: fraction of its broadcast, so a third slot buys nothing measurable and costs a bucket of memory.
DEFAULT_RING_DEPTH: int = _C.defaults["ring_depth"]
#: Contiguous tensors of at least this many bytes are broadcast where they are: no copy, no bucket.
DEFAULT_INPLACE_MIN_BYTES: int = _C.defaults["inplace_min_bytes"]
#: In-place broadcasts are issued in NCCL groups (start/endCoalescing) of about this many bytes.
DEFAULT_COALESCE_BYTES: int = _C.defaults["coalesce_bytes"]
#: A call with at most this many smaller tensors sends them in place too, in the same NCCL group: an
#: FSDP unit's two norms cost less that way than a ring (allocation, copy table, events, two kernels).
DEFAULT_SMALL_INPLACE_MAX: int = _C.defaults["small_inplace_max"]


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
    # the cross-rank agreement, and making the ring before it (on CPU: the source's first packs)
    agree_seconds: float = 0.0
    agree_wait_seconds: float = 0.0  # of which waiting for other ranks to arrive (store rounds only)
    enqueue_seconds: float = 0.0  # queueing the broadcasts (on CPU/gloo: running them)
    # tensors this rank could send in place but sent through buckets, as another rank could not
    # (a non-contiguous or unaligned copy there): routes must pair up across ranks
    rerouted: int = 0
    inplace_ops: int = 0  # broadcasts the in-place tensors took: tensors back to back in one buffer share one
    speculated: int = 0  # buckets sent ring to ring before the agreement and used (plan_sync(speculate=True))


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


class SyncPlan:
    """A plan for broadcasting the same tensors from the same source again and again.

    Made by :func:`plan_sync`. Planning (dedup, checks, routes, the copy table) happens once, in C++;
    each :meth:`run` checks that every tensor still holds the bytes, shape and dtype it was planned
    with (a re-allocated ``.data``, a ``resize_``/``set_``, or for a module a parameter or buffer
    replaced by another object), agrees with the other ranks on the plan's digest (a few small
    store messages), and broadcasts. Values may change between runs: sending them is the point.
    A changed tensor raises the same AgreementError on every rank, naming it, before any byte
    moves; ``run(replan=True)`` instead plans again where something changed and then agrees.
    Tensors added to a module after the plan was made are not part of it: make a new plan.

    With ``speculate``, the plan keeps its ring between runs, and each run after one that went
    through sends its first buckets (one per ring slot) from ring to ring while the ranks agree, so
    that the agreement's round trips overlap the transfer. Those broadcasts touch no tensor of the
    caller's; a rank that finds a change (or replans) sends them all the same and voids them in the
    agreement, and every rank then drops them. What it gives up: every rank must call run() every
    time, as for any collective; a rank that does not leaves the others' first broadcasts queued on
    the GPU (their host raises CollectiveError at the timeout) until torch's NCCL watchdog ends the
    group, where without it nothing was queued.
    """

    def __init__(self, tensors: Optional[list], src: int, group: Optional[dist.ProcessGroup], names, options: dict,
                 module_slots: Optional[Callable[[], tuple]] = None, speculate: bool = False):
        self._t0 = time.perf_counter()
        self.src, self._options = src, options
        self._speculate = speculate
        # speculate: the plan (and its layout generation) that every rank agreed on in the last run that went
        # through, and the ring that run used; None when the last run did not go through.
        self._agreed: Optional[tuple] = None
        self._ring: Optional[torch.Tensor] = None
        self._pg = _resolve_group(group)
        self._rank = dist.get_rank()
        self._names = _Names(names) if callable(names) else list(names) if names is not None else []
        self._module_slots = module_slots
        self._slots: Optional[tuple] = None  # (owners, keys, tensors): _module_slots
        if module_slots is not None:
            self._slots = module_slots()
            tensors = self._slots[2]
        self._tensors = tensors
        self._plan, self._error, self._src_group = None, None, None
        self._rerouted = 0
        self._build()

    def _build(self) -> None:
        """The local plan, or the error that the agreement reports on every rank."""
        self._plan, self._error = None, None
        try:
            self._src_group = _group_src(self._pg, self.src)  # a bad src on any rank: all raise, at the agreement
            o = self._options
            # The core writes raw storage with autograd off: parameters go in as they are (no detach(),
            # which would cost a Python object per tensor: at 16k tensors, more than the broadcast).
            def make(names_now: list):
                return _C.Plan(self._tensors, names_now, o["bucket_bytes"], o["ring_depth"], o["inplace_min_bytes"],
                               o["coalesce_bytes"], self._rank, o["small_inplace_max"])
            try:
                try:
                    self._plan = make([] if isinstance(self._names, _Names) else self._names)
                except ValueError:
                    if not isinstance(self._names, _Names):
                        raise
                    self._plan = make(list(self._names))  # raises again, naming the tensor
            except TypeError:
                _check_types(self._tensors, self._names, self._rank)
                raise
        except (TypeError, ValueError) as e:
            self._error = e

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self._tensors

    def _changed(self, start: int = 0) -> Optional[str]:
        """What changed since the plan was made, in words; None if nothing. start: inputs before it were found
        unchanged in this run already."""
        if self._slots is not None:
            i = _C.first_replaced(*self._slots)
            if i >= 0:
                label = f"tensor {i} ('{self._names[i]}')" if i < len(self._names) else f"tensor {i}"
                return (f"{label} on rank {self._rank} was replaced by another object since the plan was made "
                        f"(a parameter or buffer assigned anew)")
        if self._plan is not None:
            return self._plan.check_unchanged(start=start) or None
        return None

    @gc_paused
    def run(self, *, timeout: Optional[Union[float, timedelta]] = None, verify: bool = False,
            replan: bool = False) -> SyncStats:
        """Broadcast the plan's tensors from the source again: every rank must call it.

        timeout, verify: as in :func:`broadcast_tensors`. replan: where a tensor changed since the plan
        was made, plan again (every rank then agrees on the new plan) instead of raising.
        """
        self._t0 = time.perf_counter()
        early, checked = self._send_early(timeout)
        error = self._error
        changed = self._changed(checked) if error is None else None
        if changed is not None and not replan:
            error = ValueError(f"{changed}; make a new plan or run(replan=True)")
        elif changed is not None:
            if self._module_slots is not None:
                self._slots = self._module_slots()
                self._tensors = self._slots[2]
            self._build()
            error = self._error
        return self._send(timeout, verify, error, early)

    def _send_early(self, timeout: Optional[Union[float, timedelta]]) -> tuple[Optional[tuple], int]:
        """speculate: the first buckets, ring to ring, before this rank's check and the agreement; every rank
        sends them, whatever it finds, on the layout all agreed on in the last run that went through, with
        that run's ring (nothing to allocate). The source first checks what they read (a re-allocated
        tensor's old memory may be gone), and where that changed sends its slots unpacked. Returns
        ((the PreparedRun, its plan, the plan's layout generation then) or None, how many inputs from the
        first it found unchanged)."""
        agreed, self._agreed = self._agreed, None
        ring, self._ring = self._ring, None
        if agreed is None:
            return None, 0
        plan, generation = agreed
        is_src = self._rank == self.src
        pack = False
        if is_src and self._error is None and self._plan is plan and plan.layout_generation == generation:
            first = plan.inputs_of_buckets(plan.ring_slots)
            pack = plan.check_unchanged(first) == ""
        with group_timeout(self._pg, timeout):
            prepared = plan.prepare(is_src, pack=pack, ring=ring)
            speculate(prepared, self._pg, self._src_group, timeout)
        return (prepared, plan, generation), first if pack else 0

    def _send(self, timeout, verify: bool, error: Optional[BaseException], early: Optional[tuple] = None) -> SyncStats:
        """Agree (digest, routes, refusals: `error` is this rank's), then broadcast through the C++ pipeline.
        early: what _send_early sent, used if every rank's check passed, dropped on every rank if not."""
        pg, plan = self._pg, self._plan
        t_planned = time.perf_counter()
        if timeout is not None and isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        tensors = self._tensors
        with group_timeout(pg, timeout):
            timing: dict = {}
            device = tensors[0].device if tensors and error is None else None
            is_src = self._rank == self.src
            prepared, void = None, False
            if early is not None:
                prepared, spec_plan, generation = early
                # void: the broadcasts went on a layout this rank no longer has, or the source sent them unpacked
                void = not (error is None and spec_plan is plan and plan.layout_generation == generation
                            and (not is_src or prepared.packed > 0))
            # The ring before the agreement (csrc/pipeline.h, PreparedRun): a rank that cannot have it refuses
            # there, so that every rank raises; the source's first packs run while the ranks agree.
            elif error is None and plan.can_prepare:
                try:
                    prepared = plan.prepare(is_src)
                except Exception as e:  # out of memory, mostly: a refusal, as any rank's problem before the agreement
                    error = RuntimeError(f"rank {self._rank} could not make its ring of {plan.num_buckets} buckets "
                                         f"(bucket_bytes={self._options['bucket_bytes']}): {e}")
            try:
                allowed = check_agreement(plan, error, pg, self._src_group, self._names, timeout=timeout,
                                          device=device, timing=timing, void=void)
            except BaseException:
                prepared = early = None  # what it queued is ordered before the caller's stream, its ring freed
                raise
            # void: allowed is not None on every rank of a group of two or more; a group of one gets no routes back
            dropped = allowed is not None or void
            if dropped:
                prepared = early = None  # laid out again below: its packs are not the new buckets'
            if allowed is not None:
                inplace = plan.num_inplace
                plan.restrict_routes(allowed)
                self._rerouted += inplace - plan.num_inplace
                logger.debug("coalesced_bcast: %d tensors go through buckets on every rank, as some rank cannot "
                             "send them in place", inplace - plan.num_inplace)
            if dropped and self._speculate and plan.can_prepare:
                prepared = plan.prepare(is_src)  # a ring to keep, so that the next run speculates again
            t_agreed, t_sent = time.perf_counter(), time.monotonic()
            enqueue_seconds, ring_bytes, *_ = payload_broadcast(plan, pg, self._src_group, timeout, prepared=prepared)
            speculated = prepared.sent if prepared is not None else 0
            if self._speculate and prepared is not None:
                self._agreed, self._ring = (plan, plan.layout_generation), prepared.ring
            if timeout is not None and tensors and tensors[0].device.type == "cuda":
                # The transfer is queued, not done: wait for it, so that a source that stalls after the
                # agreement is an error here within `timeout` rather than a stuck stream.
                wait_device(tensors[0].device, "the payload broadcast", pg, as_timedelta(timeout), t_sent)
            if verify:
                verify_plan(plan, tensors, self._names, pg, self._src_group, timeout)
        stats = SyncStats(
            tensors=plan.num_inputs, unique_tensors=plan.num_unique, bytes=plan.total_bytes,
            inplace_tensors=plan.num_inplace, packed_bytes=plan.packed_bytes, buckets=plan.num_buckets,
            ring_bytes=ring_bytes, seconds=time.perf_counter() - self._t0, plan_seconds=t_planned - self._t0,
            agree_seconds=t_agreed - t_planned, enqueue_seconds=enqueue_seconds, rerouted=self._rerouted,
            inplace_ops=plan.inplace_ops, agree_wait_seconds=timing.get("wait_seconds", 0.0), speculated=speculated)
        if self._rank == self.src:
            logger.info("coalesced_bcast: sent %d tensors (%d unique, %.3f GiB, %d in place, %d buckets) in %.3f s",
                        stats.tensors, stats.unique_tensors, stats.bytes / 2**30, stats.inplace_tensors,
                        stats.buckets, stats.seconds)
        return stats


def _options(bucket_bytes, ring_depth, inplace_min_bytes, coalesce_bytes, small_inplace_max) -> dict:
    return dict(bucket_bytes=bucket_bytes, ring_depth=ring_depth, inplace_min_bytes=inplace_min_bytes,
                coalesce_bytes=coalesce_bytes, small_inplace_max=small_inplace_max)


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
        verify: after the sync, hash every tensor on every rank and compare (one small agreement round);
            raise VerifyError on every rank, naming the first differing tensor, if any rank differs.

    Every rank must call this with tensors of the same structure (checked before any byte moves).
    On CUDA the work is queued on side streams and the caller's current stream is made to wait for
    it (a call with nothing to pack broadcasts on the caller's stream itself): the tensors can be used
    at once, in stream order, without a synchronize. To send the same tensors again, keep a plan:
    :func:`plan_sync`.
    """
    options = _options(bucket_bytes, ring_depth, inplace_min_bytes, coalesce_bytes, small_inplace_max)
    plan = SyncPlan(list(tensors), src, group, names, options)
    return plan._send(timeout, verify, plan._error)


@gc_paused
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
    tensors = _module_slots(module, include_buffers)[2]  # names only when an error needs them
    return broadcast_tensors(tensors, src, group, names=lambda: module_states(module, include_buffers)[0], **options)


@gc_paused
def plan_sync(
    what: Union[nn.Module, Iterable[torch.Tensor]],
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    include_buffers: bool = True,
    names: Union[Sequence[str], Callable[[], Sequence[str]], None] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ring_depth: int = DEFAULT_RING_DEPTH,
    inplace_min_bytes: int = DEFAULT_INPLACE_MIN_BYTES,
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
    small_inplace_max: int = DEFAULT_SMALL_INPLACE_MAX,
    speculate: bool = False,
) -> SyncPlan:
    """Plan a sync of a module (its parameters and, unless ``include_buffers=False``, buffers) or of a
    list of tensors once, for :meth:`SyncPlan.run` to send again and again (weight refits, EMA copies,
    evaluation replicas). Options as in :func:`broadcast_tensors`; nothing is sent or agreed here, so
    every rank can plan at its own pace; each run agrees first, and bad input raises there, on every
    rank.

        plan = coalesced_bcast.plan_sync(model, src=0)
        for step in ...:
            optimizer.step()          # on the source
            plan.run()                # every rank: one small agreement, then the transfer

    ``speculate=True``: each run after the first sends its first buckets while the ranks agree, and the
    plan keeps its ring (``ring_depth * bucket_bytes``) between runs; see :class:`SyncPlan` for what
    that gives up.
    """
    options = _options(bucket_bytes, ring_depth, inplace_min_bytes, coalesce_bytes, small_inplace_max)
    if isinstance(what, nn.Module):
        module = what
        if names is None:
            names = lambda: module_states(module, include_buffers)[0]  # noqa: E731
        return SyncPlan(None, src, group, names, options, lambda: _module_slots(module, include_buffers), speculate)
    return SyncPlan(list(what), src, group, names, options, speculate=speculate)

"""Agreement before any payload byte moves: every rank learns whether every rank can take part, names
the same source and holds the source's structure, and on any failure every rank raises the same error.

Cost when all is well, whatever the model's size: for groups of up to STORE_MAX_RANKS ranks, one or
two small round trips per rank to the group's c10d store (with two ranks, the second to arrive makes
one round trip and sends one message); for larger groups, one all_gather of a 512-byte record per
rank. Only when a fingerprint differs does the source send its whole fingerprint and the ranks that
differ say where.

The agreement also settles which tensors go in place: a tensor contiguous and aligned on one rank
may not be on another (a transposed copy, an offset in a shared buffer), and every rank must send
the same tensors the same way or the broadcasts do not pair up. Ranks compare a hash of their routes;
only if they differ do they exchange them and all take the tensors every rank can send in place.

Timeouts: store waits and gloo honour a per-call deadline and raise; a failed wait or collective
becomes a CollectiveError here. NCCL takes every collective's deadline from its group's
options (ProcessGroupNCCL::assignTimeoutToWork) and ignores the call's, so :func:`group_timeout`
sets the NCCL group's default timeout for the length of a call (collectives other threads start on
the same group meanwhile get it too). NCCL collectives return before the GPU finishes them, and when
a deadline passes torch's watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3), but
only after waiting for debug dumps (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 60 s by default) and with no
Python error. So wherever the host needs a collective's result on NCCL (the collective agreement's
table, and with an explicit `timeout` the end of the transfer) it polls a CUDA event against the same
deadline and raises CollectiveError itself, on time; the watchdog still ends the process afterwards.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from . import _C

logger = logging.getLogger(__name__)

_RECORD = 512  # bytes per rank: 6 int64 of header, then a UTF-8 message
_HEADER = 48
_OK, _REFUSED = 0, 1


class AgreementError(ValueError):
    """Raised on every rank when a rank refused its input or its structure differs from the source's.

    No rank has written any tensor when it is raised.
    """


class CollectiveError(RuntimeError):
    """A collective of the sync failed on this rank: a rank died, did not arrive within the timeout,
    or called something else. The other ranks fail the same way (or, on NCCL, are stopped by the
    watchdog); the group should be considered broken.
    """


def process_rank(pg: dist.ProcessGroup) -> int:
    """This process's rank for messages: the global one, or the group's where there is no default group (a
    refit group made from a store)."""
    return dist.get_rank() if dist.is_initialized() else pg.rank()


def as_timedelta(timeout: Optional[float | timedelta]) -> Optional[timedelta]:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def _nccl_backend(pg: dist.ProcessGroup):
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception:  # no CUDA backend in this group
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None


@contextlib.contextmanager
def group_timeout(pg: dist.ProcessGroup, timeout: Optional[float | timedelta]) -> Iterator[None]:
    """Collectives that NCCL starts inside the block get `timeout` as their watchdog deadline.

    The group's own timeout is restored on exit (work already started keeps the deadline it got).
    A no-op for gloo, which takes the deadline from each call's options.
    """
    timeout = as_timedelta(timeout)
    backend = _nccl_backend(pg) if timeout is not None else None
    if backend is None:
        yield
        return
    try:
        old = backend.options._timeout
        backend._set_default_timeout(timeout)
    except AttributeError:  # an older torch without the knobs: the group's timeout applies
        logger.warning("coalesced_bcast: this torch cannot change an NCCL group's timeout; the group's applies")
        yield
        return
    try:
        yield
    finally:
        backend._set_default_timeout(old)


def _deadline(pg: dist.ProcessGroup, timeout: Optional[timedelta]) -> timedelta:
    """`timeout`, else the group's own (its CUDA backend's, else its CPU backend's)."""
    if timeout is not None:
        return timeout
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or a torch without the knob
            continue
    return timedelta(minutes=10)


def wait_device(device: torch.device, what: str, pg: dist.ProcessGroup, timeout: Optional[timedelta],
                t0: float) -> None:
    """Wait on the host until the work queued so far on `device`'s current stream is done, or raise
    CollectiveError once the deadline (`timeout`, else the group's) counted from `t0` (time.monotonic())
    has passed. The wait itself is in C++ (yield-spin for 50 ms, then a 1 ms poll; GIL released)."""
    if device.type == "cpu":
        return
    limit = _deadline(pg, timeout).total_seconds()
    if not _C.wait_stream(device, limit - (time.monotonic() - t0)):
        raise CollectiveError(
            f"coalesced_bcast: {what} over {pg.size()} ranks did not finish on rank {process_rank(pg)} within "
            f"{limit:g} s: a rank died, did not call the sync in time, or called another collective. The "
            f"group is unusable now (torch's NCCL watchdog will end this process).")


def to_host(t: torch.Tensor, what: str, pg: dist.ProcessGroup, timeout: Optional[timedelta], t0: float) -> torch.Tensor:
    """t on the CPU; for a device tensor, copied on the current stream and waited for with a deadline."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    wait_device(t.device, what, pg, timeout, t0)
    return host


def _sync_op(opts):
    """Ask for a synchronous collective where this torch's options have the field: AllreduceOptions lacks
    asyncOp before torch 2.8 (Allgather/BroadcastOptions have it from 2.4 on). Without it the collective
    is async and _run waits for its Work, which orders the result the same way."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def _run(name: str, pg: dist.ProcessGroup, timeout: Optional[timedelta], start, on_cpu: bool = False) -> None:
    """Run one collective; turn a peer's death or a missed deadline into a CollectiveError that says so.

    `on_cpu`: the collective's tensors are CPU tensors (gloo). gloo before torch 2.8 ignores the options'
    timeout and waits for the group's; Work.wait(timeout) bounds the host's wait on every version (on
    2.8+ gloo stops at the same deadline itself). Not on CUDA: there wait(timeout) would block the
    host until the device finishes, and the callers wait for the result against the deadline already.
    """
    t0 = time.monotonic()
    try:
        work = start()
        if work is not None:
            if on_cpu and timeout is not None:
                work.wait(timeout)
            else:
                work.wait()
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the group's timeout"
        raise CollectiveError(
            f"coalesced_bcast: {name} over {pg.size()} ranks failed on rank {process_rank(pg)} after "
            f"{time.monotonic() - t0:.1f} s (limit: {limit}): a rank died, did not call the sync in time, or "
            f"called another collective. The group is unusable now. Cause: {e}") from e


def payload_broadcast(plan, pg: dist.ProcessGroup, src: int, timeout: Optional[float | timedelta], progress=None,
                      progress_seconds: float = 0.0, leave_host_reads: bool = False, prepared=None):
    """plan.broadcast (the C++ core), with a failure turned into a CollectiveError that says what it means.

    Returns (host seconds, device ring bytes, pinned host ring bytes, host bytes sent up by batched copies); with
    leave_host_reads, a fifth value: the copies of a load source's host memory still running (None if there are
    none), for host_reads_wait."""
    timeout = as_timedelta(timeout)
    with _payload_failure(pg, timeout):
        return plan.broadcast(pg, src, timeout.total_seconds() if timeout is not None else 0.0, progress,
                              progress_seconds, leave_host_reads=leave_host_reads, prepared=prepared)


def speculate(prepared, pg: dist.ProcessGroup, src: int, timeout: Optional[float | timedelta]) -> int:
    """prepared.speculate (a kept plan's first buckets, before the agreement), failures worded as the payload's."""
    timeout = as_timedelta(timeout)
    with _payload_failure(pg, timeout):
        return prepared.speculate(pg, src, timeout.total_seconds() if timeout is not None else 0.0)


def host_reads_wait(reads, pg: dist.ProcessGroup, timeout: Optional[float | timedelta]) -> None:
    """Until the copies that payload_broadcast left running are done; a failure worded as its own."""
    with _payload_failure(pg, as_timedelta(timeout)):
        reads.wait()


@contextlib.contextmanager
def _payload_failure(pg: dist.ProcessGroup, timeout: Optional[timedelta]):
    t0 = time.monotonic()
    try:
        yield
    except RuntimeError as e:
        limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the group's timeout"
        raise CollectiveError(
            f"coalesced_bcast: the payload broadcast over {pg.size()} ranks failed on rank {process_rank(pg)} after "
            f"{time.monotonic() - t0:.1f} s (limit: {limit}); if a rank died, stalled or called another collective, "
            f"this is why. Receivers' tensors may be partly written and the group is unusable now. Cause: {e}") from e


def all_gather(out: list[torch.Tensor], inp: torch.Tensor, pg: dist.ProcessGroup,
               timeout: Optional[timedelta] = None, what: str = "all_gather") -> None:
    opts = _sync_op(AllgatherOptions())
    if timeout is not None:
        opts.timeout = timeout
    _run(what, pg, timeout, lambda: pg.allgather([out], [inp], opts), on_cpu=inp.device.type == "cpu")


def broadcast(t: torch.Tensor, group_src: int, pg: dist.ProcessGroup, timeout: Optional[timedelta] = None,
              what: str = "broadcast") -> None:
    opts = _sync_op(BroadcastOptions())
    opts.rootRank, opts.rootTensor = group_src, 0
    if timeout is not None:
        opts.timeout = timeout
    _run(what, pg, timeout, lambda: pg.broadcast([t], opts), on_cpu=t.device.type == "cpu")


def all_reduce_max(t: torch.Tensor, pg: dist.ProcessGroup, timeout: Optional[timedelta] = None,
                   what: str = "all_reduce") -> None:
    opts = _sync_op(AllreduceOptions())
    opts.reduceOp = dist.ReduceOp.MAX
    if timeout is not None:
        opts.timeout = timeout
    _run(what, pg, timeout, lambda: pg.allreduce([t], opts), on_cpu=t.device.type == "cpu")


def control_device(pg: dist.ProcessGroup) -> torch.device:
    """Where the group's small control messages live: cpu if the group has a CPU backend, else cuda."""
    types = {d.type for d in getattr(pg, "_device_types", [])}
    if not types:
        backend = str(dist.get_backend(pg))
        types = {"cuda"} if "nccl" in backend and "gloo" not in backend else {"cpu"}
    if "cpu" in types:
        return torch.device("cpu")
    if not torch.cuda.is_available():  # the same on every rank of the group: all raise, none waits
        raise ValueError(
            f"coalesced_bcast: the process group (backend {dist.get_backend(pg)}) has no backend for cpu tensors "
            f"and this process has no CUDA device to exchange control messages on, on rank {process_rank(pg)}")
    return torch.device("cuda", torch.cuda.current_device())


def backend_problem(pg: dist.ProcessGroup, device: Optional[torch.device]) -> Optional[str]:
    """Why this group cannot move tensors on `device`, or None."""
    if device is None or not hasattr(pg, "_device_types"):
        return None
    types = {d.type for d in pg._device_types}
    if device.type in types:
        return None
    return (f"the tensors are on {device} but the process group (backend {dist.get_backend(pg)}) has no backend "
            f"for {device.type} tensors")


def _record(status: int, fp_len: int, fp_hash: int, src: int, message: str, routes_hash: int = 0) -> torch.Tensor:
    rec = torch.zeros(_RECORD, dtype=torch.uint8)
    rec[:_HEADER].view(torch.int64)[:] = torch.tensor([status, fp_len, fp_hash, src, routes_hash, 0])
    raw = message.encode()[: _RECORD - _HEADER]
    rec[_HEADER:_HEADER + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else rec[:0]
    return rec


def _gather(rec: torch.Tensor, pg: dist.ProcessGroup, device: torch.device, timeout: Optional[timedelta]) -> torch.Tensor:
    t0 = time.monotonic()
    table = torch.empty((pg.size(), rec.numel()), dtype=rec.dtype, device=device)
    out = list(table.unbind(0))
    all_gather(out, rec.to(device, non_blocking=True), pg, timeout, what="the agreement all_gather")
    return to_host(table, "the agreement all_gather", pg, timeout, t0)


def _message(row: torch.Tensor) -> str:
    return bytes(row[_HEADER:].tolist()).rstrip(b"\0").decode(errors="replace")


def _label(i: int, names: Sequence[str]) -> str:
    return f"tensor {i} ('{names[i]}')" if i < len(names) and names[i] else f"tensor {i}"


def _parse(fp: torch.Tensor):
    h, r = _C.fingerprint_header, _C.fingerprint_record
    n_u = int(fp[2])
    return fp[h:h + n_u * r].view(n_u, r).tolist(), fp[h + n_u * r:].tolist()


def _describe(rec) -> str:
    dtype, ndim, nbytes, sizes = rec[0], rec[1], rec[2], rec[3:3 + min(rec[1], len(rec) - 3)]
    return f"shape {list(sizes)}{'...' if ndim > len(sizes) else ''} {_C.dtype_name(dtype)} ({nbytes} bytes)"


def first_difference(src_fp: torch.Tensor, fp: torch.Tensor, names: Sequence[str], rank: int) -> str:
    """Where this rank's structure first departs from the source's, in words."""
    src_recs, src_map = _parse(src_fp)
    recs, inputs = _parse(fp)
    for i in range(min(len(src_map), len(inputs))):
        s, m = src_recs[src_map[i]], recs[inputs[i]]
        if s != m:
            return f"{_label(i, names)}: the source has {_describe(s)}, rank {rank} has {_describe(m)}"
        if src_map[i] != inputs[i]:
            src_tie = src_map.index(src_map[i])
            tie = inputs.index(inputs[i])
            return (f"{_label(i, names)}: the source sends it as the same memory as {_label(src_tie, names)}, "
                    f"rank {rank} as the same memory as {_label(tie, names)} (tied on one side only)")
    if len(src_map) != len(inputs):
        k = min(len(src_map), len(inputs))
        what = f"{_label(k, names)} is extra" if len(inputs) > k else f"tensor {k} is missing"
        return f"the source has {len(src_map)} tensors, rank {rank} has {len(inputs)}: {what}"
    return f"rank {rank}'s fingerprint hash differs from the source's with equal structure"


def control_stream(device: torch.device):
    """Control messages on a side stream of their own (C++-owned, one per device): the host then waits
    for them alone, not for work the caller queued before the call (the payload pipeline orders itself
    after that work by an event)."""
    return _C.ControlStream(device) if device.type == "cuda" else contextlib.nullcontext()


def check_agreement(plan, error: Optional[BaseException], pg: dist.ProcessGroup, src: Optional[int],
                    names: Sequence[str], *, timeout: Optional[float | timedelta] = None,
                    device: Optional[torch.device] = None, timing: Optional[dict] = None,
                    void: bool = False) -> Optional[torch.Tensor]:
    """Raise the same AgreementError on every rank unless every rank planned the source's structure.

    `src` is the source's group rank (None when this rank could not resolve it: then `error` says why).
    `device` is where this rank's tensors live; a group without a backend for it is a refusal too.
    A rank that dies or does not arrive within `timeout` (default: the group's) makes the others raise
    CollectiveError.

    Returns None when every rank would route every tensor as this one does; else the routes every
    rank can take (``plan.routes()`` of all ranks, ANDed), for ``plan.restrict_routes``: the same on
    every rank. Routes differ where a tensor is contiguous and aligned on one rank and not another.
    `timing`, if given, receives "wait_seconds": how long this rank waited for the others (store
    agreement; the collective one does not tell waiting from working).
    `void`: what this rank sent before the agreement (a kept plan's speculate) must not be used; its routes
    then read as no other rank's, so that every rank gets routes back (not None) and starts again.
    """
    timeout = as_timedelta(timeout)
    if error is None:
        problem = backend_problem(pg, device)
        if problem is not None:
            error = ValueError(f"{problem}, on rank {dist.get_rank()}")
    store = _group_store(pg) if pg.size() <= store_max_ranks() else None
    if store is not None:
        agreement = _StoreAgreement(store, pg, timeout)
        try:
            return agreement.run(plan, error, src, names, void)
        finally:
            if timing is not None:
                timing["wait_seconds"] = agreement.waited
    cdev = control_device(pg)
    with control_stream(cdev):
        return _check_agreement(plan, error, pg, src, names, timeout, cdev, void)


# ------------------------------------------------------------------------------ over the group's store

#: Groups of at most this many ranks agree through the c10d store every group has, larger ones through
#: a collective on the group (environment: COALESCED_BCAST_STORE_AGREEMENT_MAX_RANKS).
#: Why: on NCCL the collective queues behind the previous sync's payload on the group's one stream and
#: is read back through device memory: 1.2-1.3 ms per agreement right after a 0.4 GiB payload, 0.3 ms
#: alone, on 2x H200, against one store round trip for the last rank to arrive; FSDP1 agrees once per
#: unit. But the store is one server that sees a few requests per rank per agreement, so beyond a
#: few nodes the collective, whose cost grows with log(ranks), is the better default.
STORE_MAX_RANKS = 64
_STORE_ENV = "COALESCED_BCAST_STORE_AGREEMENT_MAX_RANKS"
# Verdict flags, added to the arrival count: a rank whose layout routes differ, a rank with a problem.
_ROUTES = 1 << 20
_BAD = 1 << 40
#: Seconds and calls per store operation (compare_set, set, wait, ...) of every agreement in this process,
#: for benchmarks: how much of the agreement is the store's round trips.
store_op_seconds: dict[str, float] = {}
store_op_counts: dict[str, int] = {}


@dataclass
class _GroupState:
    """What this rank keeps between the agreements of one group."""

    prefix: str  # this group's keys in its store
    queues: bool  # the verdict goes through a queue: two ranks, a store with queues (TCPStore; not FileStore)
    seq: int = 0  # agreements so far: every rank numbers them alike
    slots: list = field(default_factory=lambda: ["", ""])  # the record each slot holds now
    own_keys: list = field(default_factory=list)  # (seq, key): route keys this rank wrote, removed at seq + 2


_groups: "weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState]" = weakref.WeakKeyDictionary()


def _group_state(pg: dist.ProcessGroup, store, op) -> _GroupState:
    """`op(fn, *args)` runs a store operation (the agreement's `_op`)."""
    state = _groups.get(pg)
    if state is None:
        # A store can outlive its group (destroy_process_group, then init_process_group on torchrun's
        # agent store): the keys of an earlier group of the same name would read as this one's. Every
        # rank adds 1 once, at the group's first agreement, so (count - 1) // size numbers this group's
        # incarnation alike on every rank. (A round trip per group, once.)
        epoch = (int(op(store.add, "coalesced_bcast/agree/groups", 1)) - 1) // pg.size()
        queues = False
        if pg.size() == 2:  # only a two-rank verdict goes through a queue
            try:
                op(store.queue_len, "coalesced_bcast/agree/queues")
                queues = True
            except (NotImplementedError, RuntimeError, AttributeError):  # FileStore; a torch before queues
                pass
        state = _groups[pg] = _GroupState(f"coalesced_bcast/agree/{epoch}/", queues)
    return state


def _file_backed(store) -> bool:
    """Whether `store`, under any PrefixStores, is a FileStore."""
    while isinstance(store, dist.PrefixStore):
        store = getattr(store, "underlying_store", None)
    return isinstance(store, dist.FileStore)


class _StoreThread:
    """A daemon thread that runs a FileStore's operations while the caller waits with a deadline.

    Why: a process killed while it writes to a FileStore leaves a torn record at the end of the file,
    and torch's FileStore then never returns from any operation: its read loop makes no progress at the
    end of the file (0 bytes read) and spins, holding the store's mutex. Waiting on this thread, the
    caller raises at its deadline instead; the thread is abandoned to its spin (the group is unusable
    then anyway), and the operation's bound method keeps the store alive: FileStore's destructor would
    wait for that mutex, and the process could not exit."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="coalesced_bcast-filestore", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self.jobs.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            del fn, args, box
            done.set()

    def call(self, fn, args: tuple, seconds: float):
        """fn(*args), or raise TimeoutError once `seconds` pass without it returning."""
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, args, box, done))
        if not done.wait(seconds):
            raise TimeoutError(f"the group's FileStore did not answer within {seconds:.1f} s (a rank killed while "
                               f"it wrote to the store leaves a torn record that torch's FileStore never reads past)")
        ok, value = box[0]
        if ok:
            return value
        raise value


# Idle store threads. A caller takes one for its operation (or starts one), so that callers on other
# threads (syncs on other groups) never queue behind a long store wait; a thread whose operation did not
# return is not put back.
_idle_store_threads: list[_StoreThread] = []
_idle_lock = threading.Lock()


def _forget_store_threads() -> None:  # a forked child has the objects, not the threads
    global _idle_lock
    _idle_lock = threading.Lock()
    _idle_store_threads.clear()


os.register_at_fork(after_in_child=_forget_store_threads)


def _bounded_store_call(fn, args: tuple, seconds: float):
    """fn(*args) on an idle store thread, or TimeoutError after `seconds`."""
    with _idle_lock:
        worker = _idle_store_threads.pop() if _idle_store_threads else None
    if worker is None:
        worker = _StoreThread()
    try:
        return worker.call(fn, args, seconds)
    except TimeoutError:
        worker = None  # still inside fn: abandoned
        raise
    finally:
        if worker is not None:
            with _idle_lock:
                _idle_store_threads.append(worker)


def store_max_ranks() -> int:
    return int(os.environ.get(_STORE_ENV, STORE_MAX_RANKS))


def _group_store(pg: dist.ProcessGroup):
    try:
        return dist.distributed_c10d._get_process_group_store(pg)
    except (AttributeError, KeyError, RuntimeError):  # a torch without it, or a group made without a store
        return None


def _structure_and_routes(plan, error: Optional[BaseException], named: int, void: bool = False) -> tuple[str, str]:
    """What ranks compare: the named source and the fingerprint's length and hash, then the routes' hash
    (for a void rank one that no other rank's can equal)."""
    if error is not None:
        return f"{named}|refused", ""
    fp_len, fp_hash, routes_hash = plan.digest()
    return f"{named}|{fp_len} {fp_hash}", f"void{dist.get_rank()}" if void else str(routes_hash)


class _StoreAgreement:
    """One agreement through the group's store. Every rank numbers agreements with a per-group counter
    (it calls collectives in the same order). Nothing is left to delete when all is well: the record
    and, with two ranks, the verdict live in one of two slots (agreement number mod 2) that the
    agreement after next reuses, once every rank has left this one.

    1. Each rank publishes its record (agreement number, named source, fingerprint hash, routes hash)
       unless another rank did first: one compare-and-set against what the slot held two agreements
       ago (every rank saw that), and compares its own with the one that is there.
    2. The verdict: with two ranks, the second to arrive knows it and pushes it onto the slot's queue
       (one message, not a round trip: on FSDP1 the second is often the rank that materialized the
       unit), and the first pops it, which empties the queue for the next use. With more ranks, or a
       store without queues (FileStore), every rank adds 1 to a counter of this agreement (plus a flag
       for what it found), the last sets the total under this agreement's key and the others wait for
       it; the first to arrive removes the keys of the agreement before last.
    3. Only when routes differ (a tensor some rank cannot send in place: another layout or alignment):
       every rank publishes which tensors it can send in place and all take those every rank can.
    4. Only on a problem: the refusal or the source naming of the lowest rank that flagged one is
       raised; failing those the source publishes its whole fingerprint, the ranks that differ
       describe the first difference, and the lowest rank's description is raised.
    """

    def __init__(self, store, pg: dist.ProcessGroup, timeout: Optional[timedelta]):
        self.store, self.pg, self.timeout = store, pg, timeout
        self.limit = _deadline(pg, timeout).total_seconds()
        self.t0 = time.monotonic()
        self.rank = dist.get_rank()
        self.waited = 0.0  # seconds blocked until other ranks had written what this one needed
        self.bounded = _file_backed(store)  # its operations run on _StoreThread, against the deadline
        self.group = _group_state(pg, store, self._op)
        self.seq = self.group.seq
        self.group.seq += 1

    def _key(self, name: str, seq: Optional[int] = None) -> str:
        return f"{self.group.prefix}{self.seq if seq is None else seq}/{name}"

    def _slot_key(self, name: str) -> str:
        return f"{self.group.prefix}slot{self.seq % 2}/{name}"

    def _op(self, fn, *args):
        t = time.perf_counter()
        try:
            if self.bounded:
                # 1 s past the deadline: a store wait that honours it raises its own error first
                left = self.limit - (time.monotonic() - self.t0)
                return _bounded_store_call(fn, args, max(left, 0.0) + 1.0)
            return fn(*args)
        except (RuntimeError, TimeoutError) as e:  # a deadline passed, the store went away with its host
            limit = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the group's timeout"
            raise CollectiveError(
                f"coalesced_bcast: the agreement over {self.pg.size()} ranks failed on rank {self.rank} after "
                f"{time.monotonic() - self.t0:.1f} s (limit: {limit}): a rank died, did not call the sync in time, "
                f"or called another collective. The group is unusable now. Cause: {e}") from e
        finally:
            name = getattr(fn, "__name__", "op")
            store_op_seconds[name] = store_op_seconds.get(name, 0.0) + time.perf_counter() - t
            store_op_counts[name] = store_op_counts.get(name, 0) + 1

    def raw(self, name: str) -> bytes:
        """The value of `name` once some rank has set it, waiting no longer than the deadline."""
        self.wait([name])
        return self._op(self.store.get, self._key(name))

    def wait(self, names: list[str]) -> None:
        self.wait_keys([self._key(n) for n in names])

    def wait_keys(self, keys: list[str]) -> None:
        t = time.monotonic()
        left = self.limit - (t - self.t0)
        if left <= 0:
            self._op(self._expired)
        self._op(self.store.wait, keys, timedelta(seconds=left))
        self.waited += time.monotonic() - t

    def get(self, name: str) -> str:
        return self.raw(name).decode(errors="replace")

    def _expired(self):
        raise RuntimeError(f"the deadline of {self.limit:g} s passed")

    def set(self, name: str, value: str | bytes) -> None:
        self._op(self.store.set, self._key(name), value)

    def add(self, name: str, n: int) -> int:
        return int(self._op(self.store.add, self._key(name), n))

    def exists(self, name: str) -> bool:
        return bool(self._op(self.store.check, [self._key(name)]))

    def keep_lowest(self, name: str, text: str) -> None:
        """Store `text` under `name` unless a lower rank stored its own (compare-and-set until so)."""
        mine = f"{self.rank:010d}|{text[:4000]}"
        cur = self._op(self.store.compare_set, self._key(name), "", mine).decode(errors="replace")
        while cur != mine and int(cur[:10]) > self.rank:
            cur = self._op(self.store.compare_set, self._key(name), cur, mine).decode(errors="replace")

    def lowest(self, name: str) -> tuple[int, str]:
        value = self.get(name)
        return int(value[:10]), value[11:]

    def barrier(self, name: str) -> None:
        if self.add(f"arrived{name}", 1) == self.pg.size():
            self.set(f"done{name}", "1")
        else:
            self.get(f"done{name}")

    def clean_up(self, n: int) -> None:
        """Keys of the agreement before the previous one, where verdicts go through keys (more than two
        ranks, or a store without queues): every rank has left it, as every rank has arrived at the
        previous one. Route keys are removed by the rank that wrote them."""
        if self.seq >= 2:
            for k in ("done",) + (("arrived",) if n != 2 else ()):
                self._op(self.store.delete_key, self._key(k, self.seq - 2))

    def publish(self, record: str) -> str:
        """Set this agreement's record in its slot unless a rank did first; the record there now.

        The slot holds the record of the agreement before last, which every rank saw: the first
        rank's compare-and-set against it succeeds, the others' return the first's record."""
        slots = self.group.slots
        cur = self._op(self.store.compare_set, self._slot_key("ref"), slots[self.seq % 2], record)
        cur = cur.decode(errors="replace")
        if not cur.startswith(f"{self.seq}#"):
            raise CollectiveError(
                f"coalesced_bcast: rank {self.rank} found {cur[:80]!r} where agreement {self.seq} of its group "
                f"keeps its record in the group's store: the ranks have called a different number of syncs on "
                f"this group, or something else writes coalesced_bcast's keys")
        slots[self.seq % 2] = cur
        return cur

    def pop_verdict(self) -> int:
        """The verdict the second rank pushed onto this slot's queue (two ranks, a store with queues),
        waited for within the deadline; popping it leaves the queue empty for the agreement after next."""
        key = self._slot_key("verdict")
        self.wait_keys([key])
        return int(self._op(self.store.queue_pop, key, False))

    def run(self, plan, error: Optional[BaseException], src: Optional[int],
            names: Sequence[str], void: bool = False) -> Optional[torch.Tensor]:
        n = self.pg.size()
        mine = self.group.own_keys
        while mine and mine[0][0] <= self.seq - 2:
            self._op(self.store.delete_key, mine.pop(0)[1])
        named = dist.get_process_group_ranks(self.pg)[src] if src is not None else -1
        structure, routes = _structure_and_routes(plan, error, named, void)
        record = f"{self.seq}#{self.rank}#{structure}#{routes}"
        cur = self.publish(record)
        first = cur == record
        _, _, ref_structure, ref_routes = cur.split("#", 3)
        bad = error is not None or ref_structure != structure
        flags = _BAD if bad else (_ROUTES if ref_routes != routes else 0)
        verdict = None
        queues = self.group.queues
        if queues and first:
            verdict = self.pop_verdict()
        elif queues:
            self._op(self.store.queue_push, self._slot_key("verdict"), str(flags))
            verdict = flags
        else:
            if n == 2 and not first:
                verdict = flags
                self.set("done", str(verdict))
            elif n != 2:
                total = self.add("arrived", 1 + flags)
                if total % _ROUTES == n:
                    verdict = total - n
                    self.set("done", str(verdict))
            if first:  # it waits for the others anyway (unless it is alone)
                self.clean_up(n)
            if verdict is None:
                verdict = int(self.get("done"))
        if verdict == 0:
            return None
        if verdict < _BAD:
            return self.common_routes(plan.routes())
        self.explain(plan, error, named, names)

    def common_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """The routes every rank can take: the bitwise AND of theirs (every rank's structure is the
        same, so is their length)."""
        n = self.pg.size()
        self.set(f"routes/{self.pg.rank()}", routes.numpy().tobytes())
        self.group.own_keys.append((self.seq, self._key(f"routes/{self.pg.rank()}")))
        self.wait([f"routes/{r}" for r in range(n)])
        allowed = routes.clone()
        for r in range(n):
            if r != self.pg.rank():
                theirs = torch.frombuffer(bytearray(self._op(self.store.get, self._key(f"routes/{r}"))),
                                          dtype=torch.uint8)
                allowed &= theirs
        return allowed

    def explain(self, plan, error: Optional[BaseException], named: int, names: Sequence[str]) -> None:
        """Some rank flagged a problem: raise the same AgreementError on every rank, saying which."""
        first = int(self._op(self.store.compare_set, self._key("src_rank"), "", str(named)))
        fp = plan.fingerprint() if error is None else None
        if error is not None:
            self.keep_lowest("refused", f"{type(error).__name__}: {error}")
        elif named != first:
            self.keep_lowest("sources", f"rank {self.rank} names {named}, another rank named {first}")
        elif named == self.rank:
            self.set("fingerprint", fp.numpy().tobytes())
        self.barrier("2")
        if self.exists("refused"):
            r, msg = self.lowest("refused")
            raise AgreementError(f"coalesced_bcast: rank {r} refused its input, so no rank sent anything: {msg}") \
                from error
        if self.exists("sources"):
            _, msg = self.lowest("sources")
            raise AgreementError(f"coalesced_bcast: the ranks name different sources, so no rank sent anything: {msg}")
        # Every rank names the same source and none refused: the source has published its fingerprint.
        src_fp = torch.frombuffer(bytearray(self.raw("fingerprint")), dtype=torch.int64)
        if not torch.equal(src_fp, fp):
            self.keep_lowest("difference", first_difference(src_fp, fp, names, self.rank))
        self.barrier("3")
        if self.exists("difference"):
            r, msg = self.lowest("difference")
            raise AgreementError(
                f"coalesced_bcast: rank {r} does not match source rank {named}, so no rank sent anything: {msg}")
        raise AgreementError(f"coalesced_bcast: the ranks' fingerprint hashes differ but no rank found a difference "
                             f"from source rank {named}'s fingerprint")


def _check_agreement(plan, error: Optional[BaseException], pg: dist.ProcessGroup, src: Optional[int],
                     names: Sequence[str], timeout: Optional[timedelta], cdev: torch.device,
                     void: bool = False) -> None:
    """The agreement as one all_gather over the group (and, on a mismatch, a broadcast and another)."""
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    src_global = ranks[src] if src is not None else -1
    if error is not None:
        rec = _record(_REFUSED, 0, 0, src_global, f"{type(error).__name__}: {error}")
    else:
        fp_len, fp_hash, routes_hash = plan.digest()
        rec = _record(_OK, fp_len, fp_hash, src_global, "", -1 - rank if void else routes_hash)
    table = _gather(rec, pg, cdev, timeout)
    heads = table[:, :_HEADER].contiguous().view(torch.int64)
    refused = [r for r in range(pg.size()) if int(heads[r, 0]) == _REFUSED]
    if refused:
        r = refused[0]
        raise AgreementError(
            f"coalesced_bcast: rank {ranks[r]} refused its input, so no rank sent anything: "
            f"{_message(table[r])}") from error
    srcs = [int(heads[r, 3]) for r in range(pg.size())]
    if len(set(srcs)) > 1:
        named = ", ".join(f"rank {ranks[r]} names {srcs[r]}" for r in range(pg.size()))
        raise AgreementError(f"coalesced_bcast: the ranks name different sources, so no rank sent anything: {named}")
    src_len, src_hash = int(heads[src, 1]), int(heads[src, 2])
    if all(int(heads[r, 1]) == src_len and int(heads[r, 2]) == src_hash for r in range(pg.size())):
        if len({int(heads[r, 4]) for r in range(pg.size())}) == 1:
            return None
        # Same structure, other routes: every rank's routes (one byte per unique tensor, as many on
        # every rank), and what every rank can do.
        return functools.reduce(torch.bitwise_and, _gather(plan.routes(), pg, cdev, timeout).unbind(0))
    fp = plan.fingerprint()  # no rank refused: every rank has a plan
    src_fp = fp.clone() if pg.rank() == src else torch.empty(src_len, dtype=torch.int64)
    src_fp = src_fp.to(cdev)
    t0 = time.monotonic()
    what = "the agreement's fingerprint broadcast"
    broadcast(src_fp, src, pg, timeout, what=what)
    src_fp = to_host(src_fp, what, pg, timeout, t0)
    mine = "" if torch.equal(src_fp, fp) else first_difference(src_fp, fp, names, rank)
    table = _gather(_record(_OK, 0, 0, src_global, mine), pg, cdev, timeout)
    for r in range(pg.size()):
        msg = _message(table[r])
        if msg:
            raise AgreementError(
                f"coalesced_bcast: rank {ranks[r]} does not match source rank {ranks[src]}, so no rank sent "
                f"anything: {msg}")
    raise AgreementError("coalesced_bcast: fingerprints differ but no rank found a difference")  # unreachable

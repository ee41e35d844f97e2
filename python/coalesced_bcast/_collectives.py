"""Timeouts and collective wrappers: every collective and device wait of the package goes through here, and a
failed one becomes a CollectiveError that says what it means.

Store waits and gloo honour a per-call deadline and raise. NCCL takes every collective's deadline from its
group's options (ProcessGroupNCCL::assignTimeoutToWork) and ignores the call's, so :func:`group_timeout`
sets the NCCL group's default timeout for the length of a call (collectives other threads start on the
same group meanwhile get it too). NCCL collectives return before the GPU finishes them, and when a
deadline passes torch's watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING), but only after
waiting for debug dumps (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC) and with no Python error. So wherever the
host needs a collective's result on NCCL (an agreement's table, a metadata broadcast, and with an
explicit `timeout` the end of the transfer) it polls a CUDA event against the same deadline and raises
CollectiveError itself, on time; the watchdog still ends the process afterwards.
"""
from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

from . import _C

logger = logging.getLogger(__name__)


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
    has passed. The wait itself is in C++ (a short yield-spin, then a poll; GIL released)."""
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


def control_stream(device: torch.device):
    """Control messages on a side stream of their own (C++-owned, one per device): the host then waits
    for them alone, not for work the caller queued before the call (the payload pipeline orders itself
    after that work by an event)."""
    return _C.ControlStream(device) if device.type == "cuda" else contextlib.nullcontext()

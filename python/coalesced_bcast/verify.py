"""Prove after a sync that every rank holds the source's bytes, at the cost of one small agreement round.

Each rank hashes every tensor where it lives (csrc/verify*.{h,cpp,cu}: a 64-bit hash per tensor over its
bytes in logical order, any single changed word always detected; two launches on CUDA whatever the
number of tensors) and folds the hashes into one digest. One agreement round (agree.Agreement: through
the group's store for small groups, else one small all_gather) of (digest, count) tells every rank
whether all digests are equal. Only on a difference do the ranks reduce the per-tensor hashes to find
the first differing tensor and gather each rank's hash of it, so that every rank raises the same
VerifyError naming it and the ranks that differ from the source.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C
from ._collectives import all_gather, all_reduce_max, as_timedelta, control_device, to_host
from .agree import OK, Agreement, Record


_RECORD_BYTES = 32  # a verify's record: its header (digest and count) and no message

class VerifyError(RuntimeError):
    """Raised on every rank when some rank's tensors differ from the source's after a sync."""


@dataclass(frozen=True)
class VerifyStats:
    tensors: int  # tensors hashed
    bytes: int  # bytes hashed on this rank
    seconds: float  # wall time of the whole check on this rank: hashing, the collective, the wait


def tensor_hashes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor a 64-bit hash of its bytes in logical order, then their digest: int64 [n + 1], on the
    tensors' device (queued on the current stream on CUDA)."""
    return _C.hash_tensors(list(tensors))  # only read, through raw pointers: no detach() needed


def _hex(v: int) -> str:
    return f"{v & (2**64 - 1):016x}"


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _label(index: int, names: Sequence[str]) -> str:
    return f"tensor {index}" + (f" ('{names[index]}')" if index < len(names) and names[index] else "")


def _verify(tensors: Sequence[torch.Tensor], label: Callable[[int], str], nbytes: int, pg: dist.ProcessGroup,
            src: int, timeout: Optional[timedelta]) -> VerifyStats:
    """`src` is the source's group rank; label(i) names tensor i (called only on failure: an f-string per
    tensor costs time)."""
    t0 = time.perf_counter()
    hashes = tensor_hashes(tensors)
    n = len(tensors)
    digest = int(to_host(hashes[n:], "the verify hash", pg, timeout, time.monotonic())[0])
    verdict = Agreement(pg, timeout, size=_RECORD_BYTES).verdict(Record(OK, digest, n))
    if verdict.agreed:
        return VerifyStats(tensors=n, bytes=nbytes, seconds=time.perf_counter() - t0)
    counts = [rec.count for rec in verdict.records]
    if len(set(counts)) > 1:  # every rank got here, so every rank raises this
        raise VerifyError(f"coalesced_bcast verify: the ranks passed between {min(counts)} and {max(counts)} tensors "
                          f"(rank {dist.get_rank()} passed {n}); nothing can be compared")
    ranks = dist.get_process_group_ranks(pg)
    cdev = control_device(pg)

    # Rare path: find the tensors that differ, then who differs from the source on the first one.
    per = hashes[:n].to(cdev)
    per = torch.cat([per, ~per])
    all_reduce_max(per, pg, timeout, what="the verify all_reduce of per-tensor hashes")
    differs = (per[:n] != ~per[n:]).nonzero().flatten().tolist()
    first = differs[0]
    mine = hashes[first:first + 1].to(cdev)
    table = [torch.empty_like(mine) for _ in range(pg.size())]
    all_gather(table, mine, pg, timeout, what="the verify all_gather")
    seen = [int(t.item()) for t in table]
    bad = [ranks[r] for r in range(pg.size()) if seen[r] != seen[src]]
    raise VerifyError(
        f"coalesced_bcast verify: {len(differs)} tensor(s) differ across ranks after the sync; the first is "
        f"{label(first)} ({_describe(tensors[first])}): rank(s) {bad} hold different bytes than source rank "
        f"{ranks[src]} (hash {', '.join(f'rank {ranks[r]} {_hex(seen[r])}' for r in range(pg.size()))})")


def verify_tensors(tensors: Sequence[torch.Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None, *,
                   names: Optional[Sequence[str]] = None,
                   timeout: Optional[float | timedelta] = None) -> VerifyStats:
    """Check that every rank's ``tensors`` hold the source's bytes; raise VerifyError on every rank if not.

    Collective: every rank of ``group`` must call it with tensors of the same structure. ``src`` is a
    global rank. Costs one hash pass over the tensors where they live and one agreement round; tied
    tensors passed twice are hashed twice (pass each once to save the time).
    """
    if not dist.is_initialized():
        raise RuntimeError("coalesced_bcast verify needs torch.distributed to be initialized")
    pg = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(pg)
    if src not in ranks:
        raise ValueError(f"src={src} is not a rank of the group (its global ranks: {ranks[:16]}), "
                         f"on rank {dist.get_rank()}")
    names = list(names) if names is not None else []
    tensors = list(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return _verify(tensors, lambda i: _label(i, names), nbytes, pg, ranks.index(src), as_timedelta(timeout))


def verify_plan(plan, tensors: Sequence[torch.Tensor], names: Sequence[str], pg: dist.ProcessGroup, src: int,
                timeout: Optional[float | timedelta]) -> VerifyStats:
    """verify_tensors over a plan's unique tensors (tied ones once), named by their first input."""
    first = plan.unique_first_input
    unique = tensors if len(first) == len(tensors) else [tensors[i] for i in first]
    return _verify(unique, lambda u: _label(first[u], names), plan.total_bytes, pg, src, as_timedelta(timeout))

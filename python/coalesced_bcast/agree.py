"""Agreement before any payload byte moves: every rank learns whether every rank can take part and holds
what the source holds, and on any failure every rank raises the same error.

One record per rank, :class:`Record` (status, digest, count, message), and one verdict over the group,
:meth:`Agreement.verdict`: every rank learns whether every rank's status, digest and count equal its own
with none refused, and where not, every rank's record, so that each front-end (sync, load, refit, verify)
words its own error. Groups of up to STORE_MAX_RANKS ranks agree through the group's c10d store
(_store_agreement: with two ranks, one compare-and-set and one queue message when all is well), larger
ones through one all_gather of a fixed-size record per rank. :func:`broadcast_bytes` (and
:func:`broadcast_object`) move metadata from one rank to all; :func:`broadcast_record` moves one record.
Timeouts and collective wrappers live in _collectives, re-exported here.

The sync's agreement (:func:`check_agreement`) also settles which tensors go in place: a tensor contiguous
and aligned on one rank may not be on another (a transposed copy, an offset in a shared buffer), and every
rank must send the same tensors the same way or the broadcasts do not pair up. Its record's count is the
hash of its routes; only if those differ do the ranks exchange them and all take the tensors every rank
can send in place. Only when a structure differs does the source send its whole fingerprint and the
ranks that differ say where.
"""
from __future__ import annotations

import functools
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C, _store_agreement
from ._collectives import (CollectiveError, all_gather, all_reduce_max, as_timedelta, backend_problem,  # noqa: F401
                           broadcast, control_device, control_stream, group_timeout, host_reads_wait,
                           payload_broadcast, process_rank, speculate, to_host, wait_device)
from ._store_agreement import StoreRounds, store_op_counts, store_op_seconds  # noqa: F401

OK, REFUSED = 0, 1  # a record's status; front-ends may add their own above these
RECORD_BYTES = 512  # bytes per rank in a collective verdict by default: 3 int64, then a UTF-8 message
_HEAD = 24
META_CHUNK = 512 << 10  # metadata moves through device memory in pieces this size: small-pool blocks only

#: Groups of at most this many ranks agree through the c10d store every group has, larger ones through
#: a collective on the group (environment: COALESCED_BCAST_STORE_AGREEMENT_MAX_RANKS, read here only).
#: Why: on NCCL the collective queues behind the previous sync's payload on the group's one stream and
#: is read back through device memory, where the store costs one round trip for the last rank to
#: arrive; FSDP1 agrees once per unit. But the store is one server that sees a few requests per rank
#: per agreement, so beyond a few nodes the collective, whose cost grows with log(ranks), is the better
#: default.
STORE_MAX_RANKS = 64
_STORE_ENV = "COALESCED_BCAST_STORE_AGREEMENT_MAX_RANKS"


def store_max_ranks() -> int:
    return int(os.environ.get(_STORE_ENV, STORE_MAX_RANKS))


class AgreementError(ValueError):
    """Raised on every rank when a rank refused its input or its structure differs from the source's.

    No rank has written any tensor when it is raised.
    """


@dataclass(frozen=True)
class Record:
    """What one rank says in a verdict: its status (OK, REFUSED, or a front-end's own), a digest and a
    count that the verdict compares across ranks, and a message (a refusal's words), cut to fit."""

    status: int
    digest: int = 0
    count: int = 0
    message: str = ""

    def clipped(self, nbytes: int) -> "Record":
        raw = self.message.encode()
        if len(raw) <= nbytes:
            return self
        words = raw[:max(nbytes - 6, 0)].decode(errors="ignore") + " [...]"
        return Record(self.status, self.digest, self.count, words)


class Verdict:
    """Every rank's records of one round, the same on every rank.

    ``agreed``: every rank's status, digest and count equal this rank's and none refused. Then the other
    ranks' messages are not sent: ``records`` repeats this rank's record for each.
    """

    def __init__(self, mine: Record, records: Optional[list[Record]], size: int):
        self.mine = mine
        head = (mine.status, mine.digest, mine.count)
        self.agreed = mine.status != REFUSED and (records is None or all(
            r.status != REFUSED and (r.status, r.digest, r.count) == head for r in records))
        self.records = records if records is not None else [mine] * size

    def refused(self) -> Optional[tuple[int, str]]:
        """The lowest group rank that refused, and its message; None if none did."""
        return next(((r, rec.message) for r, rec in enumerate(self.records) if rec.status == REFUSED), None)

    def differ(self, src: int) -> list[int]:
        """The group ranks whose digest or count differs from group rank `src`'s."""
        ref = self.records[src]
        return [r for r, rec in enumerate(self.records) if (rec.digest, rec.count) != (ref.digest, ref.count)]

    def statuses(self) -> set[int]:
        return {rec.status for rec in self.records}


def _encode(record: Record, size: int) -> torch.Tensor:
    rec = torch.zeros(size, dtype=torch.uint8)
    rec[:_HEAD].view(torch.int64).copy_(torch.tensor([record.status, record.digest, record.count]))
    raw = record.message.encode()[: size - _HEAD]
    if raw:
        rec[_HEAD:_HEAD + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return rec


def _decode(table: torch.Tensor) -> list[Record]:
    table = table.reshape(-1, table.shape[-1])
    heads = table[:, :_HEAD].contiguous().view(torch.int64).tolist()
    raw = table[:, _HEAD:].contiguous().numpy()
    return [Record(s, d, c, raw[r].tobytes().rstrip(b"\0").decode(errors="replace"))
            for r, (s, d, c) in enumerate(heads)]


class Agreement:
    """One front-end's agreement on a group: its rounds (:meth:`verdict`), and off the fast path the
    exchanges and shares that explain a difference, under one deadline (`timeout`, else the group's).

    Every rank of `pg` makes the same calls in the same order. A rank that dies or does not arrive in
    time makes the others raise CollectiveError. `size`: bytes per record in a collective verdict
    (messages are cut to fit it, through the store too, so that both word alike).
    """

    def __init__(self, pg: dist.ProcessGroup, timeout: Optional[float | timedelta] = None, *,
                 size: int = RECORD_BYTES):
        self.pg, self.timeout, self.size = pg, as_timedelta(timeout), size
        store = None
        if 1 < pg.size() <= store_max_ranks():
            store = _store_agreement._group_store(pg)
        self._store = StoreRounds(store, pg, self.timeout) if store is not None else None
        self._cdev: Optional[torch.device] = None

    @property
    def waited(self) -> float:
        """Seconds this rank waited for the others (store rounds; a collective does not tell waiting from working)."""
        return self._store.waited if self._store is not None else 0.0

    def _device(self) -> torch.device:
        if self._cdev is None:
            self._cdev = control_device(self.pg)
        return self._cdev

    def verdict(self, record: Record) -> Verdict:
        """One round: every rank's record, or that all agree (see :class:`Verdict`)."""
        record = record.clipped(self.size - _HEAD)
        n = self.pg.size()
        if n == 1:
            return Verdict(record, None, 1)
        if self._store is not None:
            rows = self._store.verdict(record.status, record.digest, record.count, record.message)
            records = None if rows is None else [Record(*map(int, h.split()), m) for _, h, m in rows]
            return Verdict(record, records, n)
        return Verdict(record, _decode(self._gather(_encode(record, self.size), "the agreement all_gather")), n)

    def _gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        cdev = self._device()
        with control_stream(cdev):
            t0 = time.monotonic()
            table = torch.empty((self.pg.size(), t.numel()), dtype=t.dtype, device=cdev)
            all_gather(list(table.unbind(0)), t.to(cdev, non_blocking=True), self.pg, self.timeout, what=what)
            return to_host(table, what, self.pg, self.timeout, t0)

    def exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's uint8 tensor `t` (as many bytes on every rank), in group rank order."""
        if self.pg.size() == 1:
            return [t]
        if self._store is not None:
            return [torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else torch.zeros(0, dtype=torch.uint8)
                    for b in self._store.exchange(t.numpy().tobytes())]
        return list(self._gather(t, "the agreement all_gather").unbind(0))

    def share(self, blob: Optional[bytes], src: int, what: str = "the agreement's broadcast") -> bytes:
        """Group rank `src`'s `blob` on every rank (None elsewhere)."""
        if self.pg.size() == 1:
            return blob
        if self._store is not None:
            return self._store.share(blob, src)
        return bytes(broadcast_bytes(blob, self.pg, src, timeout=self.timeout, what=what))


def verdict(record: Record, pg: dist.ProcessGroup, *, timeout: Optional[float | timedelta] = None,
            size: int = RECORD_BYTES) -> Verdict:
    """One round of a one-round agreement: :meth:`Agreement.verdict`."""
    return Agreement(pg, timeout, size=size).verdict(record)


def broadcast_record(record: Optional[Record], pg: dist.ProcessGroup, src: int, *,
                     timeout: Optional[float | timedelta] = None, what: str = "the verdict broadcast",
                     size: int = RECORD_BYTES) -> Record:
    """Group rank `src`'s record on every rank, in one broadcast of `size` bytes (None elsewhere)."""
    if pg.size() == 1:
        return record
    timeout = as_timedelta(timeout)
    cdev = control_device(pg)
    rec = _encode(record.clipped(size - _HEAD), size) if pg.rank() == src else torch.zeros(size, dtype=torch.uint8)
    with control_stream(cdev):
        t0 = time.monotonic()
        rec = rec.to(cdev)
        broadcast(rec, src, pg, timeout, what)
        return _decode(to_host(rec, what, pg, timeout, t0))[0]


def broadcast_bytes(blob: Optional[bytes], pg: dist.ProcessGroup, src: int, *,
                    timeout: Optional[float | timedelta] = None, what: str = "the metadata broadcast",
                    chunk: int = META_CHUNK):
    """Group rank `src`'s `blob` (None elsewhere) on every rank: its length, then its bytes, on the group's
    control device and stream. Over gloo the bytes go as they lie, in one broadcast; through device memory
    they go in pieces of `chunk` bytes, so that metadata takes small-pool blocks only. Each wait on the
    host has the deadline. Returns `blob` on the source, a memoryview of the bytes elsewhere."""
    if pg.size() == 1:
        return blob
    timeout = as_timedelta(timeout)
    cdev = control_device(pg)
    is_src = pg.rank() == src
    with control_stream(cdev):
        t0 = time.monotonic()
        n = torch.tensor([len(blob) if is_src else 0], dtype=torch.int64, device=cdev)
        broadcast(n, src, pg, timeout, what)
        total = int(to_host(n, what, pg, timeout, t0).item())
        host = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if is_src and total
                else torch.empty(total, dtype=torch.uint8))
        if cdev.type == "cpu":
            if total:
                broadcast(host, src, pg, timeout, what)
        else:
            part = torch.empty(min(total, chunk), dtype=torch.uint8, device=cdev)
            for lo in range(0, total, chunk):
                piece = part[:min(chunk, total - lo)]
                if is_src:
                    piece.copy_(host[lo:lo + piece.numel()])
                t0 = time.monotonic()
                broadcast(piece, src, pg, timeout, what)
                if not is_src:
                    wait_device(cdev, what, pg, timeout, t0)
                    host[lo:lo + piece.numel()].copy_(piece)
    return blob if is_src else memoryview(host.numpy())


def broadcast_object(obj: Any, pg: dist.ProcessGroup, src: int, *, timeout: Optional[float | timedelta] = None,
                     what: str = "the metadata broadcast") -> Any:
    """Group rank `src`'s `obj` on every rank, pickled, through :func:`broadcast_bytes`."""
    is_src = pg.rank() == src
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_src else None
    out = broadcast_bytes(blob, pg, src, timeout=timeout, what=what)
    return obj if is_src else pickle.loads(out)


# ------------------------------------------------------------------------------------- the sync's agreement

_M1, _M2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def _structure_digest(named: int, fp_len: int, fp_hash: int) -> int:
    """The named source and the fingerprint's length and hash, as one signed 64-bit digest."""
    d = (fp_hash ^ ((fp_len * _M1) & (2**64 - 1)) ^ (((named + 2) * _M2) & (2**64 - 1))) & (2**64 - 1)
    return d - 2**64 if d >= 2**63 else d


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
    `timing`, if given, receives "wait_seconds": how long this rank waited for the others.
    `void`: what this rank sent before the agreement (a kept plan's speculate) must not be used; its routes
    then read as no other rank's, so that every rank gets routes back (not None) and starts again.
    """
    if error is None:
        problem = backend_problem(pg, device)
        if problem is not None:
            error = ValueError(f"{problem}, on rank {dist.get_rank()}")
    agreement = Agreement(pg, timeout)
    try:
        return _sync_agreement(agreement, plan, error, src, names, void)
    finally:
        if timing is not None:
            timing["wait_seconds"] = agreement.waited


def _sync_agreement(agreement: Agreement, plan, error: Optional[BaseException], src: Optional[int],
                    names: Sequence[str], void: bool) -> Optional[torch.Tensor]:
    """The first round compares the structure (digest) and the routes (count); the rest only on a difference."""
    pg, rank = agreement.pg, dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    named = ranks[src] if src is not None else -1
    if error is not None:
        mine = Record(REFUSED, message=f"{type(error).__name__}: {error}")
    else:
        fp_len, fp_hash, routes_hash = plan.digest()
        mine = Record(OK, _structure_digest(named, fp_len, fp_hash), -1 - rank if void else routes_hash)
    v = agreement.verdict(mine)
    if v.agreed:
        return None
    refused = v.refused()
    if refused is not None:
        raise AgreementError(f"coalesced_bcast: rank {ranks[refused[0]]} refused its input, so no rank sent "
                             f"anything: {refused[1]}") from error
    if len({rec.digest for rec in v.records}) == 1:
        # Same structure, other routes (or a void rank): every rank's routes (one byte per unique tensor,
        # as many on every rank), and what every rank can do.
        return functools.reduce(torch.bitwise_and, agreement.exchange(plan.routes()))
    _explain(agreement, plan, named, src, names, ranks)


def _explain(agreement: Agreement, plan, named: int, src: int, names: Sequence[str], ranks: list[int]) -> None:
    """Some rank's structure differs (none refused): raise the same AgreementError on every rank, saying how."""
    fp = plan.fingerprint()
    v = agreement.verdict(Record(OK, named))
    if not v.agreed:
        words = ", ".join(f"rank {ranks[r]} names {rec.digest}" for r, rec in enumerate(v.records))
        raise AgreementError(f"coalesced_bcast: the ranks name different sources, so no rank sent anything: {words}")
    mine_is_src = agreement.pg.rank() == src
    blob = agreement.share(fp.numpy().tobytes() if mine_is_src else None, src,
                           "the agreement's fingerprint broadcast")
    src_fp = torch.frombuffer(bytearray(blob), dtype=torch.int64)
    differs = "" if torch.equal(src_fp, fp) else first_difference(src_fp, fp, names, dist.get_rank())
    found = agreement.verdict(Record(REFUSED if differs else OK, message=differs)).refused()
    if found is not None:
        raise AgreementError(f"coalesced_bcast: rank {ranks[found[0]]} does not match source rank {named}, so no "
                             f"rank sent anything: {found[1]}")
    raise AgreementError(f"coalesced_bcast: the ranks' fingerprint hashes differ but no rank found a difference "
                         f"from source rank {named}'s fingerprint")


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



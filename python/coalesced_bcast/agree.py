"""Agreement before any payload byte moves: every rank learns whether every rank can take part and
holds the source's structure, and on any failure every rank raises the same error.

Cost when all is well: one all_gather of a 512-byte record per rank, whatever the model's size.
Only when a fingerprint differs does the source broadcast its whole fingerprint and the ranks
gather one message each.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C

_RECORD = 512  # bytes per rank: 4 int64 of header, then a UTF-8 message
_HEADER = 32
_OK, _REFUSED = 0, 1


class AgreementError(ValueError):
    """Raised on every rank when a rank refused its input or its structure differs from the source's.

    No rank has written any tensor when it is raised.
    """


def _control_device(pg: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hash(fp: torch.Tensor) -> int:
    return int.from_bytes(hashlib.blake2b(fp.numpy().tobytes(), digest_size=8).digest(), "little", signed=True)


def _record(status: int, fp_len: int, fp_hash: int, message: str) -> torch.Tensor:
    rec = torch.zeros(_RECORD, dtype=torch.uint8)
    rec[:_HEADER].view(torch.int64)[:3] = torch.tensor([status, fp_len, fp_hash])
    raw = message.encode()[: _RECORD - _HEADER]
    rec[_HEADER:_HEADER + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else rec[:0]
    return rec


def _gather(rec: torch.Tensor, pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    out = [torch.empty_like(rec, device=device) for _ in range(pg.size())]
    dist.all_gather(out, rec.to(device), group=pg)
    return torch.stack(out).cpu()


def _message(row: torch.Tensor) -> str:
    return bytes(row[_HEADER:].tolist()).rstrip(b"\0").decode(errors="replace")


def _label(i: int, names: Sequence[str]) -> str:
    return f"tensor {i} ('{names[i]}')" if i < len(names) and names[i] else f"tensor {i}"


def _parse(fp: torch.Tensor):
    h, r = _C.fingerprint_header, _C.fingerprint_record
    n_in, n_u = int(fp[1]), int(fp[2])
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


def check_agreement(plan, error: Optional[BaseException], pg: dist.ProcessGroup, src: int,
                    names: Sequence[str]) -> None:
    """Raise the same AgreementError on every rank unless every rank planned the source's structure."""
    device = _control_device(pg)
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    if error is not None:
        rec = _record(_REFUSED, 0, 0, f"{type(error).__name__}: {error}")
        fp = None
    else:
        fp = plan.fingerprint()
        rec = _record(_OK, fp.numel(), _hash(fp), "")
    table = _gather(rec, pg, device)
    heads = table[:, :_HEADER].contiguous().view(torch.int64)
    refused = [r for r in range(pg.size()) if int(heads[r, 0]) == _REFUSED]
    if refused:
        r = refused[0]
        raise AgreementError(
            f"coalesced_bcast: rank {ranks[r]} refused its input, so no rank sent anything: "
            f"{_message(table[r])}") from error
    src_len, src_hash = int(heads[src, 1]), int(heads[src, 2])
    if all(int(heads[r, 1]) == src_len and int(heads[r, 2]) == src_hash for r in range(pg.size())):
        return
    src_fp = fp.clone() if pg.rank() == src else torch.empty(src_len, dtype=torch.int64)
    src_fp = src_fp.to(device)
    dist.broadcast(src_fp, ranks[src], group=pg)
    src_fp = src_fp.cpu()
    mine = "" if torch.equal(src_fp, fp) else first_difference(src_fp, fp, names, rank)
    table = _gather(_record(_OK, 0, 0, mine), pg, device)
    for r in range(pg.size()):
        msg = _message(table[r])
        if msg:
            raise AgreementError(
                f"coalesced_bcast: rank {ranks[r]} does not match source rank {ranks[src]}, so no rank sent "
                f"anything: {msg}")
    raise AgreementError("coalesced_bcast: fingerprints differ but no rank found a difference")  # unreachable


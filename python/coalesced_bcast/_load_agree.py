"""load_full_state_dict's agreement: one record per rank (status, a digest of the keys it loads, their number,
its errors), gathered by every rank, so that every rank raises the same verdict before anything is written;
and strict's verdict after the post-hooks, where they may clear missing or unexpected keys."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ._load_keys import _NO_MODEL_STATE, _ModelState, _strict_errors
from .agree import control_stream
from .state_dict import LoadStateDictError

if TYPE_CHECKING:
    from ._load_plan import _Plan

_RECORD = 4096  # bytes per rank in the verdict all_gather: 3 int64, then a UTF-8 message
_REFUSED, _AFTER_HOOKS = 1, 2  # a record's status, beside 0: ready


def _digest(load_keys: list[str], extra: Mapping[str, nn.Module],
            model_keys: _ModelState = _NO_MODEL_STATE) -> int:
    """The keys this rank loads, and which of them hold extra state, hashed: ranks whose models differ differ."""
    h = hashlib.blake2b(digest_size=8)  # each key, then 1 if it holds extra state else 0: one update
    if extra:
        h.update("".join(k + ("\1" if k in extra else "\0") for k in load_keys).encode())
    elif load_keys is model_keys.keys and model_keys.joined is not None and load_keys:  # every key of the model
        h.update((model_keys.joined + "\0").encode())
    elif load_keys:
        h.update(("\0".join(load_keys) + "\0").encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def _gather_records(status: int, digest: int, n: int, msg: str, pg: dist.ProcessGroup,
                    ctrl: torch.device) -> tuple[list[list[int]], Callable[[int], str]]:
    """One all_gather of a small record per rank: the heads [status, digest, n] and each rank's message.

    On the control stream (agree.control_stream: high priority, its own): the host then waits for the records
    alone, not for the caller's work or the source's first packs queued before the agreement (_prepare)."""
    if pg.size() == 1:  # nothing to gather: this rank's own record
        return [[status, digest, n]], lambda r: msg
    rec = torch.zeros(_RECORD, dtype=torch.uint8)
    rec[:24].view(torch.int64).copy_(torch.tensor([status, digest, n]))
    raw = msg.encode()[: _RECORD - 24]
    if raw:
        rec[24:24 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with control_stream(ctrl):
        out = [torch.empty(_RECORD, dtype=torch.uint8, device=ctrl) for _ in range(pg.size())]
        dist.all_gather(out, rec.to(ctrl), group=pg)
        table = torch.stack(out).cpu()

    def text(r: int) -> str:
        words = bytes(table[r, 24:].tolist()).rstrip(b"\0").decode(errors="replace")
        return words + (" [...]" if len(words.encode()) >= _RECORD - 24 - 4 else "")
    return table[:, :24].contiguous().view(torch.int64).tolist(), text


def _agree(plan: _Plan, pg: dist.ProcessGroup, src_g: int, ctrl: torch.device, rank: int) -> bool:
    """Every rank raises the same verdict, before any write. Returns whether some rank judges strict only
    after the post-hooks (then every rank takes part in that verdict: _strict_after_hooks)."""
    msg = "\n\t".join(plan.errors)
    status = _REFUSED if msg else _AFTER_HOOKS if plan.strict_after_hooks else 0
    heads, text = _gather_records(status, plan.digest, plan.num_keys, msg, pg, ctrl)
    ranks = dist.get_process_group_ranks(pg)
    if msg:
        raise LoadStateDictError(f"load_full_state_dict: no rank loaded anything. {msg}")
    for r, (status, digest, n) in enumerate(heads):
        if status == _REFUSED:
            raise LoadStateDictError(f"load_full_state_dict: rank {ranks[r]} refused, so no rank loaded anything. "
                                     f"{text(r)}")
    src_digest, src_n = heads[src_g][1], heads[src_g][2]
    for r, (_, digest, n) in enumerate(heads):
        if (digest, n) != (src_digest, src_n):
            raise LoadStateDictError(
                f"load_full_state_dict: rank {ranks[r]} would load {n} keys of the checkpoint and source rank "
                f"{ranks[src_g]} {src_n} (or the same number of different keys): the models differ, so no rank "
                f"loaded anything")
    return any(head[0] == _AFTER_HOOKS for head in heads)


def _strict_after_hooks(plan: _Plan, model: nn.Module, strict: bool, pg: dist.ProcessGroup, ctrl: torch.device,
                        rank: int, hook_error: Optional[BaseException]) -> None:
    """strict, judged on the keys the post-hooks left, as load_state_dict judges it: every rank raises the
    same verdict (the tensors are written by then, as load_state_dict has written them when it raises), also
    where a rank's set_extra_state or post-hook raised."""
    errors = _strict_errors(plan.missing, plan.unexpected) if strict else []
    if hook_error is not None:
        errors = [f"{type(hook_error).__name__} from set_extra_state or a post-hook: {hook_error}"]
    msg = ""
    if errors:
        msg = "\n\t".join([f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:"] + errors)
    heads, text = _gather_records(_REFUSED if msg else 0, 0, 0, msg, pg, ctrl)
    ranks = dist.get_process_group_ranks(pg)
    for r, head in enumerate(heads):
        if head[0] == _REFUSED:
            raise LoadStateDictError(f"load_full_state_dict: the tensors were loaded, but after the load's post-hooks "
                                     f"rank {ranks[r]} still has: {text(r)}") from hook_error

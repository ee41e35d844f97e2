"""load_full_state_dict's agreement: one record per rank (status, a digest of the keys it loads, their number,
its errors), in one verdict of the agreement module (agree.verdict), so that every rank raises the same verdict before anything is written;
and strict's verdict after the post-hooks, where they may clear missing or unexpected keys."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Mapping, Optional

import torch.distributed as dist
import torch.nn as nn

from ._load_keys import _NO_MODEL_STATE, _ModelState, _strict_errors
from .agree import OK, REFUSED, Record, verdict
from .state_dict import LoadStateDictError

if TYPE_CHECKING:
    from ._load_plan import _Plan

_RECORD = 4096  # bytes per rank in a collective verdict: room for a strict error's list of keys
_AFTER_HOOKS = REFUSED + 1  # a record's status beside OK and REFUSED: strict is judged after the post-hooks


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


def _agree(plan: _Plan, pg: dist.ProcessGroup, src_g: int) -> bool:
    """Every rank raises the same verdict, before any write. Returns whether some rank judges strict only
    after the post-hooks (then every rank takes part in that verdict: _strict_after_hooks)."""
    msg = "\n\t".join(plan.errors)
    status = REFUSED if msg else _AFTER_HOOKS if plan.strict_after_hooks else OK
    v = verdict(Record(status, plan.digest, plan.num_keys, msg), pg, size=_RECORD)
    ranks = dist.get_process_group_ranks(pg)
    if msg:
        raise LoadStateDictError(f"load_full_state_dict: no rank loaded anything. {msg}")
    refused = v.refused()
    if refused is not None:
        raise LoadStateDictError(f"load_full_state_dict: rank {ranks[refused[0]]} refused, so no rank loaded "
                                 f"anything. {refused[1]}")
    for r in v.differ(src_g):
        raise LoadStateDictError(
            f"load_full_state_dict: rank {ranks[r]} would load {v.records[r].count} keys of the checkpoint and "
            f"source rank {ranks[src_g]} {v.records[src_g].count} (or the same number of different keys): the "
            f"models differ, so no rank loaded anything")
    return _AFTER_HOOKS in v.statuses()


def _strict_after_hooks(plan: _Plan, model: nn.Module, strict: bool, pg: dist.ProcessGroup, rank: int,
                        hook_error: Optional[BaseException]) -> None:
    """strict, judged on the keys the post-hooks left, as load_state_dict judges it: every rank raises the
    same verdict (the tensors are written by then, as load_state_dict has written them when it raises), also
    where a rank's set_extra_state or post-hook raised."""
    errors = _strict_errors(plan.missing, plan.unexpected) if strict else []
    if hook_error is not None:
        errors = [f"{type(hook_error).__name__} from set_extra_state or a post-hook: {hook_error}"]
    msg = ""
    if errors:
        msg = "\n\t".join([f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:"] + errors)
    refused = verdict(Record(REFUSED if msg else OK, message=msg), pg, size=_RECORD).refused()
    if refused is not None:
        ranks = dist.get_process_group_ranks(pg)
        raise LoadStateDictError(f"load_full_state_dict: the tensors were loaded, but after the load's post-hooks "
                                 f"rank {ranks[refused[0]]} still has: {refused[1]}") from hook_error

"""The functions that install() puts in place of torch's FSDP1 and DDP sync functions, and the record
of the calls they serve or hand back to torch (see coalesced_bcast.install for which name each replaces).

Each replacement takes torch's own function as its first argument (install's _wrap binds it), so that
it can hand a call back to torch: for a group or tensors coalesced_bcast does not serve
(_fallback_reason), or a refusal that torch's path takes without an error (_HANDED_BACK).
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Container, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import fsdp as _fsdp
from .agree import AgreementError, CollectiveError, check_agreement
from .sync import SyncStats, broadcast_tensors

logger = logging.getLogger(__name__)

_FSDP = "torch.distributed.fsdp._init_utils"
_DDP = "torch.nn.parallel.distributed"
_FLAT = "torch.distributed.fsdp._flat_param"
_FSDP_SYNCED = "_fsdp_synced"  # the mark FSDP1 puts on buffers it synced (FSDP_SYNCED in _init_utils)


@dataclass(frozen=True)
class PatchedCall:
    """One sync that went through a patched torch function: served by coalesced_bcast (``stats``), or
    handed to torch's own function (``fallback`` says why; ``stats`` is None)."""

    site: str  # "fsdp1" or "ddp"
    stats: Optional[SyncStats]
    fallback: Optional[str] = None


@dataclass
class _FsdpUnit:
    module: nn.Module
    group: dist.ProcessGroup
    cpu_ok: bool
    fallback: bool = False  # torch's own functions sync this unit


_history: deque[PatchedCall] = deque(maxlen=4096)
_unit: contextvars.ContextVar[Optional[_FsdpUnit]] = contextvars.ContextVar("coalesced_bcast_fsdp_unit",
                                                                             default=None)


def _group(pg: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return pg if pg is not None else dist.group.WORLD


def _has_gloo(pg: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(pg))


def _record(site: str, stats: SyncStats) -> None:
    _history.append(PatchedCall(site, stats))
    logger.debug("coalesced_bcast: %s sync of %d tensors (%d bytes) went through coalesced_bcast",
                 site, stats.tensors, stats.bytes)


_fallbacks_logged: set[tuple[str, str]] = set()


def _fallback_reason(pg: dist.ProcessGroup, tensors: list[torch.Tensor]) -> Optional[str]:
    """Why this sync goes to torch's own function instead, or None when coalesced_bcast serves it.

    Only facts every rank of the group shares decide it (the group's class, whether torch.distributed
    knows it, the device type of its tensors, which torch's own path needs alike on every rank), so no
    rank falls back while another does not. torch's _broadcast_coalesced takes any ProcessGroup
    object; ours needs the group's registration (global ranks, its store) and a backend for the device.
    """
    if type(pg) is not dist.ProcessGroup:  # a Python subclass overrides what the C++ core would call
        return (f"the group is a {type(pg).__module__}.{type(pg).__qualname__}, not a ProcessGroup made by "
                f"torch.distributed (one implemented in Python, or a bare backend)")
    try:
        dist.get_process_group_ranks(pg)
    except (ValueError, RuntimeError, KeyError):
        return "the group is not registered with torch.distributed (made without new_group/init_process_group)"
    device = next((t.device for t in tensors if t.device.type != "meta"), None)
    types = {d.type for d in getattr(pg, "_device_types", [])}
    if device is not None and types and device.type not in types:
        return f"the group (backend {dist.get_backend(pg)}) has no backend for {device.type} tensors"
    return None


#: How _ddp_verify_params words its refusal in the agreement (it hands the sync back: _HANDED_BACK).
_DDP_CHECK_FAILED = "raised in DDP's check that every rank's parameters match rank 0's"

#: What the planner refuses (csrc/plan.cpp) and torch's path takes without an error, so that the patched calls
#: hand it back, with the reason they record: different views of overlapping memory (a buffer that is a row or
#: the transpose of a parameter: torch copies each view in turn, coalesced_bcast sends each byte once), and a
#: lazy conjugate or negative bit (its bytes are not its values). Torch does not always sync the latter (over
#: gloo, a conjugate view broadcast beside a float tensor can keep each rank's own values); handed back, the
#: outcome is torch's either way.
_HANDED_BACK = {
    "are different views of overlapping memory":
        "some rank's parameters or buffers include different views of overlapping memory (a buffer that is a "
        "view of a parameter)",
    "has a lazy conjugate or negative bit": "some rank's parameters or buffers have a lazy conjugate or negative bit",
    _DDP_CHECK_FAILED:  # _ddp_verify_params' refusal
        "a rank raised in DDP's check that its parameters match rank 0's (sizes, strides or count), so it never "
        "calls the sync; torch's function queues the source's broadcast as torch's own init does",
}


def _handed_back_reason(e: AgreementError) -> Optional[str]:
    return next((why for words, why in _HANDED_BACK.items() if words in str(e)), None)


def _send_or_hand_back(site: str, send: Callable[[], SyncStats], torch_own: Callable[[], Any]) -> Any:
    """send(); where some rank refused what torch's path serves (_HANDED_BACK), torch's own function instead. The
    refusal reaches every rank in the same AgreementError before any byte moves: every rank hands it back alike."""
    try:
        stats = send()
    except AgreementError as e:
        reason = _handed_back_reason(e)
        if reason is None:
            raise
        _fall_back(site, reason)
        return torch_own()
    _record(site, stats)
    return None


def _fall_back(site: str, reason: str) -> None:
    """Record a call handed to torch, and say why once per (site, reason) at INFO."""
    _history.append(PatchedCall(site, None, reason))
    if (site, reason) not in _fallbacks_logged:
        _fallbacks_logged.add((site, reason))
        logger.info("coalesced_bcast: %s syncs over this kind of group use torch's own function: %s", site, reason)


def _tensor_names(module: nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """Names for error messages, as '<UnitClass>.path' (a unit does not know its own path in the model).

    The tensors arrive detached: match them by address, dtype and shape.
    """
    where: dict[tuple, str] = {}
    prefix = f"<{type(module).__name__}>."
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if t is not None and not t.is_meta:
            where.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)),
                             prefix + name.replace("_fsdp_wrapped_module.", ""))
    return [where.get((t.data_ptr(), t.dtype, tuple(t.shape)), "") for t in tensors]


# ---------------------------------------------------------------------------------------------- FSDP1

def _fsdp_sync_params_and_buffers(original: Callable, process_group: dist.ProcessGroup,
                                  module_states: list[torch.Tensor], broadcast_bucket_size: int, src: int) -> None:
    """Replaces torch.distributed.utils._sync_params_and_buffers as FSDP1's _init_utils sees it.

    ``src`` is a group rank there (it goes to c10d's broadcast_coalesced); bucket size is ignored,
    as the ring bounds the memory instead. An empty list still joins the agreement, so that a rank
    whose list is not empty fails with a message instead of hanging.
    """
    pg = _group(process_group)
    reason = _fallback_reason(pg, module_states)
    if reason is not None:
        _fall_back("fsdp1", reason)
        return original(process_group, module_states, broadcast_bucket_size, src)
    unit = _unit.get()
    names = functools.partial(_tensor_names, unit.module, module_states) if unit is not None else None
    return _send_or_hand_back(
        "fsdp1", lambda: broadcast_tensors(module_states, dist.get_global_rank(pg, src), pg, names=names),
        lambda: original(process_group, module_states, broadcast_bucket_size, src))


def _fsdp_check_module_states(original: Callable, module_states: list[torch.Tensor]) -> None:
    """Replaces FSDP1's refusal of CPU states: allowed over gloo, refused with the tensor's name otherwise."""
    unit = _unit.get()
    if unit is None or unit.fallback:  # outside FSDP1's per-unit sync, or torch syncs this unit: its own check
        return original(module_states)
    if unit.cpu_ok:
        return None
    cpu = [i for i, t in enumerate(module_states) if t.device.type == "cpu"]
    if not cpu:
        return None
    try:  # torch's own refusal, word for word (callers and torch's tests match it), then which tensor
        original(module_states)
        message = "The module has CPU parameters or buffers when `sync_module_states=True`."
    except ValueError as e:
        message = str(e)
    name = _tensor_names(unit.module, [module_states[cpu[0]]])[0] or f"state {cpu[0]}"
    raise ValueError(
        f"{message} On rank {dist.get_rank()}, {len(cpu)} of the unit's {len(module_states)} parameters and "
        f"buffers are on the CPU (first: '{name}', shape {list(module_states[cpu[0]].shape)}), and the process "
        f"group's backend '{dist.get_backend(unit.group)}' cannot broadcast CPU tensors; a gloo group can.")


def _fsdp_sync_module_params_and_buffers(original: Callable, module: nn.Module, params: list[nn.Parameter],
                                         process_group: dist.ProcessGroup) -> None:
    """Wraps FSDP1's per-unit sync: on a structure mismatch (raised on every rank before any byte
    moves), restore the source's ties on the other ranks and retry once.

    ``params`` is FSDP's own list of the unit's managed parameters, which it flattens next: a re-tie
    edits it in place so that it keeps matching the source's deduplicated list.
    """
    pg = _group(process_group)
    states = [*params, *module.buffers()]
    if _fallback_reason(pg, states) is not None:  # torch's path, untouched (the mover records why)
        token = _unit.set(_FsdpUnit(module, pg, False, fallback=True))
        try:
            return original(module, params, process_group)
        finally:
            _unit.reset(token)
    token = _unit.set(_FsdpUnit(module, pg, _has_gloo(pg)))
    try:
        unsynced = [b for b in module.buffers() if not getattr(b, _FSDP_SYNCED, False)]
        # One buffer per unit on every rank (the others have theirs from fsdp.param_init_fn already):
        # one broadcast per unit, and FSDP1's flatten without a copy.
        _fsdp.lay_out_unit(module, params)
        try:
            return original(module, params, process_group)
        except AgreementError as first:
            mismatch = first
        # Every rank is here (the agreement raises everywhere). The failed call already marked
        # the buffers synced; unmark them so the retry sends them.
        for b in unsynced:
            setattr(b, _FSDP_SYNCED, False)
        src = dist.get_global_rank(pg, 0)
        retied = _fsdp.restore_ties(module, src, pg, only=params)
        if retied:  # a re-pointed name left the unit's buffer: lay it out again
            _fsdp.lay_out_unit(module, params)
        logger.info("coalesced_bcast: FSDP unit %s did not match source rank %d (%s); after restoring the "
                    "source's ties (%d re-pointed on rank %d), retrying", type(module).__name__, src, mismatch,
                    retied, dist.get_rank())
        try:
            return original(module, params, process_group)
        except AgreementError as second:
            raise AgreementError(
                f"{second} (after restoring the source's tied weights on every rank; tied weights are "
                f"supported within one FSDP unit, or across units with coalesced_bcast.fsdp.param_init_fn)"
            ) from mismatch
    finally:
        _unit.reset(token)


def _fsdp_materialize_with_param_init_fn(original: Callable, root_module: nn.Module, param_init_fn: Callable,
                                         ignored_modules: set) -> None:
    """Wraps FSDP1's call of ``param_init_fn`` on a unit's modules: our materializer gets the whole
    unit at once (one buffer for its parameters, see MetaMaterializer.materialize_unit); any other
    ``param_init_fn`` is called as torch calls it."""
    ours = _materializer_inside(param_init_fn)
    if ours is None:
        return original(root_module, param_init_fn, ignored_modules)
    modules = importlib.import_module(_FSDP)._get_modules_to_materialize(root_module, ignored_modules)
    ours.materialize_unit(modules)
    if ours is not param_init_fn:  # a framework's wrapper around ours: its own work, on modules now real
        return original(root_module, param_init_fn, ignored_modules)


def _materializer_inside(fn: Any, depth: int = 3) -> Optional[_fsdp.MetaMaterializer]:
    """``fn`` itself if it is our materializer, or one that a framework wrapped (a closure such as
    accelerate's ensure_weights_retied, a functools.partial, a functools.wraps wrapper), else None."""
    if isinstance(fn, _fsdp.MetaMaterializer):
        return fn
    if depth == 0:
        return None
    inner = [getattr(fn, "func", None), getattr(fn, "__wrapped__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for f in inner:
        if callable(f) and not isinstance(f, type):
            found = _materializer_inside(f, depth - 1)
            if found is not None:
                return found
    return None


def _fsdp_flatten_tensors(original: Callable, handle: Any, tensors: list[torch.Tensor], aligned_numel: int):
    """Wraps FlatParamHandle.flatten_tensors: a unit laid out in one buffer by our materializer becomes
    its FlatParameter as it is; torch copies anything else."""
    flat = _fsdp.flatten_in_place(tensors, aligned_numel)
    return flat if flat is not None else original(handle, tensors, aligned_numel)


# ------------------------------------------------------------------------------------------------ DDP

def _ddp_sync_module_states(original: Callable, module: nn.Module, process_group: dist.ProcessGroup,
                            broadcast_bucket_size: int, src: int, params_and_buffers_to_ignore: Container[str],
                            broadcast_buffers: bool = True) -> None:
    """Replaces torch.distributed.utils._sync_module_states as DDP sees it: the same tensors
    (deduplicated parameters, then buffers, minus the ignored names), from the same group rank."""
    names, states = [], []
    for name, p in module.named_parameters():
        if name not in params_and_buffers_to_ignore:
            names.append(name)
            states.append(p.detach())
    if broadcast_buffers:
        for name, b in module.named_buffers():
            if name not in params_and_buffers_to_ignore:
                names.append(name)
                states.append(b.detach())
    pg = _group(process_group)
    reason = _fallback_reason(pg, states)
    if reason is None and len({t.device for t in states}) > 1:
        # A multi-device module (model parallel inside one process): torch buckets per device.
        reason = f"the module spans several devices ({', '.join(sorted({str(t.device) for t in states}))})"
    if reason is not None:
        _fall_back("ddp", reason)
        return original(
            module, process_group, broadcast_bucket_size, src, params_and_buffers_to_ignore, broadcast_buffers)
    return _send_or_hand_back(
        "ddp", lambda: broadcast_tensors(states, dist.get_global_rank(pg, src), pg, names=names),
        lambda: original(module, process_group, broadcast_bucket_size, src, params_and_buffers_to_ignore,
                         broadcast_buffers))


#: torch's words when that check finds a difference (reducer.cpp, verify_params_across_processes: the count
#: on every rank, sizes and strides on the ranks other than 0)
_DDP_MISMATCH = ("appears not to match sizes of the same param", "appears not to match strides of the same param",
                 "DDP expects same model across all ranks")


def _ddp_verify_params(original: Callable, process_group: dist.ProcessGroup, tensors: list[torch.Tensor],
                       logger: Any = None) -> None:  # noqa: shadows the module's: torch's keyword
    """Wraps DDP's check that every rank's parameters match rank 0's (the step before its init sync).

    torch raises that mismatch of sizes or strides on the ranks that differ, not on rank 0 (which only
    broadcasts its own), so rank 0 goes on to the sync alone: torch's NCCL path queues a broadcast and
    returns, ours would wait in the agreement for a rank that never comes. So a rank that raises there
    joins that agreement first, with its error as its refusal: every rank then hands the sync to torch
    (_HANDED_BACK), and this rank then raises torch's error. Only where this rank would have been
    served (every rank decides alike from the group and the device type), so that the others do run
    our agreement. One case it cannot see: rank 0's buffers on another device than its parameters send
    rank 0's sync to torch, and this rank then waits for it until the group's timeout before raising.
    """
    try:
        return original(process_group, tensors, logger)
    except RuntimeError as e:
        if not any(words in str(e) for words in _DDP_MISMATCH):
            raise  # a collective that failed, ...: no agreement would be joined either
        pg = _group(process_group)
        if _fallback_reason(pg, tensors) is not None or len({t.device for t in tensors}) > 1:
            raise
        refusal = ValueError(f"rank {dist.get_rank()} {_DDP_CHECK_FAILED}, before the sync: {e}")
        try:
            check_agreement(None, refusal, pg, 0, [])
        except AgreementError as verdict:
            _fall_back("ddp", _handed_back_reason(verdict) or str(verdict))
        except CollectiveError as lost:  # rank 0 did not come (its states' devices sent it to torch): torch's error
            logging.getLogger(__name__).warning(
                "coalesced_bcast: rank %d failed DDP's parameter check and rank 0 did not reach the sync's "
                "agreement: %s", dist.get_rank(), lost)
        raise


# ------------------------------------------------------------------------------ what install() patches

#: (module, or module.Class, that holds the name; the name; its replacement; what a torch without it loses)
_REPLACEMENTS: list[tuple[str, str, Callable, str]] = [
    (_FSDP, "_sync_module_params_and_buffers", _fsdp_sync_module_params_and_buffers,
     "FSDP1 will not restore tied weights lost by to_empty"),
    (_FSDP, "_sync_params_and_buffers", _fsdp_sync_params_and_buffers,
     "FSDP1's sync_module_states keeps torch's broadcast"),
    (_FSDP, "_check_module_states_for_sync_module_states", _fsdp_check_module_states,
     "FSDP1 keeps refusing CPU modules, gloo included"),
    (_FSDP, "_materialize_with_param_init_fn", _fsdp_materialize_with_param_init_fn,
     "fsdp.param_init_fn materializes module by module and FSDP1 copies each unit to flatten it"),
    (_FLAT + ".FlatParamHandle", "flatten_tensors", _fsdp_flatten_tensors,
     "FSDP1 copies each unit to flatten it"),
    (_DDP, "_sync_module_states", _ddp_sync_module_states, "DDP's init sync keeps torch's broadcast"),
    (_DDP, "_verify_param_shape_across_processes", _ddp_verify_params,
     "a rank that fails DDP's parameter check leaves rank 0 waiting in the agreement until the group's timeout"),
]

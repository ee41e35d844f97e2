"""load_full_state_dict's plan and ring: this rank's share of the load planned in C++ from the matched keys
(csrc/load_dests.h, csrc/load_plan.cpp), the ring made before the agreement, the source's first buckets packed
early, the transfer through the ring, and the model's post-hooks after it."""
from __future__ import annotations

import functools
import logging
import os
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C, _dtensor
from ._load_agree import _digest
from ._load_keys import _in_checkpoint_order, _match_keys, _ModelState, _usual_match
from .agree import payload_broadcast

logger = logging.getLogger(__name__)

#: Post-hooks judged between looks at whether the plan is made: few, so that the transfer starts soon after.
_HOOKS_PER_STEP = 256


class _Plan:
    """This rank's share of the load: key matching's outcome and the engine's plan."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.extras: list[tuple[Any, nn.Module]] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.strict_after_hooks = False  # strict is judged after post-hooks that may clear keys
        self.num_keys = 0
        self.cast_keys = 0
        self.digest = 0
        self.tensors = 0  # distinct checkpoint tensors with bytes
        self.total = 0  # their bytes
        self.core = None  # the engine's plan (_C.start_load_plan(...).result())
        self.hooks: Any = None  # a _C.HookJudgment of the post-hooks, begun while the plan was made
        self.prepared: Any = None  # the engine's ring made before the agreement (_prepare), for the transfer
        self.prepacked = 0  # of its buckets, those packed while the source planned (_prepack)
        self.direct_buckets = 0  # buckets received straight into this rank's tensors (_transfer)
        self.ring_bytes = 0
        self.host_ring_bytes = 0
        self.host_batched_bytes = 0


def _plan_load(model: nn.Module, model_sd: Optional[Mapping[str, Any]], model_keys: _ModelState,
               extra: Mapping[str, nn.Module], owned: Any, meta: dict, src_tensors: Any, strict: bool,
               device: torch.device, is_src: bool, rank: int, error: Optional[str], bucket_bytes: int,
               ring_depth: int, copy_threads: Optional[int]) -> _Plan:
    """This rank's plan and ring, made after the metadata is out (the other ranks plan from it meanwhile); on the
    source the first buckets packed while it plans."""
    prepack = (_prepack(meta, src_tensors, device, bucket_bytes, ring_depth, rank, copy_threads, model_sd,
                        model_keys, extra) if is_src else None)
    plan = _plan_local(model, model_sd, model_keys, extra, owned, meta, src_tensors, strict, device, rank, error,
                       bucket_bytes, ring_depth, copy_threads)
    _prepare(plan, model, is_src, rank, bucket_bytes, prepack)  # takes the prepack's ring, or lets it go
    return plan


def _plan_local(model: nn.Module, model_sd: Optional[Mapping[str, Any]], model_keys: _ModelState,
                extra: Mapping[str, nn.Module],
                owned: Any, meta: dict, src_tensors: Any, strict: bool, device: torch.device, rank: int,
                error: Optional[str], bucket_bytes: int, ring_depth: int, copy_threads: Optional[int]) -> _Plan:
    plan = _Plan()
    try:
        if error is not None:
            plan.errors.append(error)
        else:
            _plan_keys(plan, model, model_sd, model_keys, extra, owned, meta, src_tensors, strict, device, rank,
                       bucket_bytes, ring_depth, copy_threads)
    except Exception as e:  # a bug or a refusal of the engine must reach the other ranks, not strand them
        plan.errors.append(f"{type(e).__name__}: {e}")
    if plan.errors:
        plan.errors.insert(0, f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:")
    return plan


def _prepack(meta: dict, src_tensors: Any, device: torch.device, bucket_bytes: int, ring_depth: int,
             rank: int, copy_threads: Optional[int], model_sd: Optional[Mapping[str, Any]],
             model_keys: _ModelState, extra: Mapping[str, nn.Module]) -> Any:
    """The source's first buckets (one per ring slot) read from the checkpoint's host memory into a ring while
    it still plans (csrc/prepack.cpp): on a GPU the copy up the bus is the load's slowest leg, and those buckets'
    copies need only the metadata table, the tensors and the order of the model's keys. A _C.Prepack for
    _prepare, or None: nothing to win (a CPU model, sources on the GPU), a load matched key by key (extra states,
    refused values: _match_keys' loop), or it could not be made (out of memory: the ring made with the plan says
    so in the agreement)."""
    if (device.type != "cuda" or meta.get("table") is None or not isinstance(src_tensors, _C.TensorList)
            or model_sd is None or extra or meta["extras"] or meta["bad"]):
        return None
    try:
        rows = None  # the table's rows as they come
        if not _in_checkpoint_order(meta, model_sd, model_keys):
            rows = _usual_match(meta, model_sd).rows  # shared with _match_keys, which runs next
            if rows is None:
                return None
        return _C.prepack_load(meta["table"], meta["canon"], rows, src_tensors, bucket_bytes, ring_depth, rank,
                               _copy_threads(copy_threads), device)
    except Exception as e:
        logger.debug("load_full_state_dict: no prepack on rank %d: %s", rank, e)
        return None


def _copy_threads(copy_threads: Optional[int]) -> int:
    if copy_threads is None:
        copy_threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    return max(1, int(copy_threads))


def _prepare(plan: _Plan, model: nn.Module, is_src: bool, rank: int, bucket_bytes: int, early: Any = None) -> None:
    """The ring before the agreement (csrc/pipeline.h, PreparedRun), as a sync makes it: a rank that cannot have
    it (out of memory) refuses in the agreement, so that every rank raises with nothing written, where after it
    that rank alone would fail while the others wait in the first broadcast; and the source's first buckets are
    read from the checkpoint (host memory: the bus's slowest leg) while the ranks agree, or were read while it
    planned (early: _prepack's, whose ring the run takes where it packed those buckets as this plan does)."""
    core = plan.core
    if core is None or plan.errors or not core.can_prepare:
        return
    try:
        plan.prepared = core.prepare(is_src, early=early)
        plan.prepacked = plan.prepared.prepacked
    except Exception as e:  # out of memory, mostly
        plan.errors += [f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:",
                        f"rank {rank} could not make its ring of {core.ring_slots} buckets "
                        f"(bucket_bytes={bucket_bytes}): {type(e).__name__}: {e}"]


def _plan_keys(plan: _Plan, model: nn.Module, model_sd: Mapping[str, Any], model_keys: _ModelState,
               extra: Mapping[str, nn.Module], owned: Any, meta: dict, src_tensors: Any, strict: bool,
               device: torch.device, rank: int, bucket_bytes: int, ring_depth: int,
               copy_threads: Optional[int]) -> None:
    """Keys matched, each value's destination found (load_dests) and the engine's plan made, into `plan`."""
    if (bucket_bytes, ring_depth) != (meta["bucket_bytes"], meta["ring_depth"]):
        plan.errors.append(f"bucket_bytes={bucket_bytes}, ring_depth={ring_depth} on rank {rank}, but the source "
                           f"uses {meta['bucket_bytes']}, {meta['ring_depth']}; pass the same options everywhere")
        return
    load_keys, values, value_rows, value_keys, extra = _match_keys(plan, model, model_sd, model_keys, extra, meta,
                                                                   strict, rank)
    copy_threads = _copy_threads(copy_threads)
    table = meta["table"]
    # The usual load (every checkpoint tensor a unit of its own, in the model's key order) is planned while
    # load_dests runs, fed its destinations as it finds them (csrc/dest_feed.h); the source's pack runs are made
    # then too. A checkpoint in another order (sorted keys) is fed its table and tensors in the model's order.
    fed = None
    if len(values) == table.size(0):
        fed_rows, fed_table, fed_sources = value_rows, table, src_tensors if src_tensors is not None else []
        if value_rows is not meta["rows"]:  # (meta's rows: the table's order, _match_keys' usual case)
            fed_table = table.index_select(0, value_rows)
            if src_tensors is not None:
                fed_sources = src_tensors.take(value_rows)
        fed = _C.start_fed_load_plan(fed_table, fed_sources, len(values), bucket_bytes, ring_depth, rank,
                                     copy_threads, device)
    try:
        local, meta_t, units_t, unit_src_rows, plan.cast_keys, problems = _load_dests(
            values, value_rows, meta, owned, device, rank, fed)
    except BaseException:
        if fed is not None:
            fed.close(False)
        raise
    plan.errors += [msg.replace(_C.key_mark, value_keys[i]) for i, msg in problems]
    # Units in model order (ties on a rank are written in load_state_dict's order); the source's tensors
    # in the same order (by table row).
    n = table.size(0)
    in_order = unit_src_rows.numel() == n and bool(torch.equal(unit_src_rows, torch.arange(n)))
    if fed is not None:  # not used where a tensor was named twice (csrc/dest_feed.h)
        fed.close(not plan.errors and unit_src_rows.numel() == n and bool(torch.equal(unit_src_rows, fed_rows)))
    plan.num_keys = len(load_keys)
    plan.digest = _digest(load_keys, extra, model_keys)
    if plan.errors:
        return
    if fed is not None and fed.used:
        pending = fed
    else:
        if fed is not None:
            fed.result()  # (None) its thread done reading the source's tensors, which `take` moves out
            local = fed.dests()  # load_dests put the destinations in the feed alone
        sources = []
        if src_tensors is not None:  # a _C.TensorList on the source (one per table row)
            sources = src_tensors if in_order else src_tensors.take(unit_src_rows)
        pending = _C.start_load_plan(units_t, sources, local, meta_t, bucket_bytes, ring_depth, rank, copy_threads,
                                     device)
    _judge_hooks(plan, model, device, pending, pending is fed)
    plan.core = pending.result()
    plan.tensors, plan.total = plan.core.num_units_sent, plan.core.total_bytes


def _load_dests(values: list, value_rows: torch.Tensor, meta: dict, owned: Any, device: torch.device, rank: int,
                fed: Any) -> tuple:
    """_C.load_dests over the matched values: per value its checks, unit and box (DTensors on n-D meshes, or
    meshes this rank is not in, through torch's own layout: _dtensor_box, found once per mesh, placements and
    shape)."""
    boxes: dict = {}

    def mesh_facts(mesh) -> tuple[bool, int, int, int]:
        coord = mesh.get_coordinate()
        one_d = mesh.ndim == 1
        return (coord is not None, coord[0] if coord is not None and one_d else 0, mesh.ndim,
                mesh.size(0) if one_d else 0)

    def nd_box(mesh, placements, shape):
        memo = (id(mesh), id(placements), shape)  # ids: hashing placements runs Python per call
        found = boxes.get(memo)
        if found is None:
            found = boxes[memo] = _dtensor_box(mesh, placements, shape)
        return found

    DTensor, Replicate, Shard = _dtensor.classes()
    return _C.load_dests(values, value_rows, meta["table"], meta["canon"], owned, DTensor, Shard, Replicate,
                         mesh_facts, nd_box, device, rank, _scalar_from_any_1dim(), feed=fed)


def _judge_hooks(plan: _Plan, model: nn.Module, device: torch.device, pending: Any, fed_plan: bool) -> None:
    """Whether FSDP2's post-hooks would all do nothing after the in-place writes, judged (plan.hooks) while the
    plan is made beside: the Python objects they read, under the GIL, are ones the writes do not change, but
    set_extra_state (plan.extras) may, and then _run_post_hooks judges them after it. On a CPU model the judgment
    runs here in full. On a GPU it runs until the plan is made, and _run_post_hooks does the rest once the
    transfer is queued, beside the copies; a fed plan is all but made when load_dests returns, so there is no wait
    to fill and the judgment's walk of the modules would only hold back the transfer: all of it is left to
    _run_post_hooks."""
    after = _judge_hooks_after_transfer(device)
    if plan.extras or (after and fed_plan):
        return
    plan.hooks = _C.HookJudgment(model)
    if after:
        while not pending.done() and plan.hooks.step(_HOOKS_PER_STEP) is None:
            pass
    else:
        plan.hooks.verdict()


def _judge_hooks_after_transfer(device: torch.device) -> bool:
    """Whether the post-hooks' judgment may be left until the transfer is queued: where the copies run on a GPU,
    beside the host."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=None)
def _scalar_from_any_1dim() -> bool:
    """Whether this torch's load_state_dict puts the first element of a 1-dim value of any length into a 0-dim
    tensor (its rule for torch 0.3 checkpoints; later versions take a value of one element only)."""
    m = nn.Module()
    m.register_buffer("x", torch.zeros(()))
    try:
        m.load_state_dict({"x": torch.ones(2)})
    except RuntimeError:
        return False
    return True


def _dtensor_box(mesh, placements, shape: tuple[int, ...]):
    """(problem, the global offset of this rank's box or None if it holds none, the box's shape), for a
    DTensor on a mesh of other than one dim or one this rank is not in (load_dests does 1-D meshes)."""
    _, Replicate, Shard = _dtensor.classes()
    bad = [p for p in placements if type(p) is not Shard and type(p) is not Replicate]
    if bad:
        return f"placement {bad[0]} is not supported (only Shard(dim) and Replicate)", None, None
    if mesh.get_coordinate() is None:
        return None, None, None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    lshape, off = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return None, tuple(off), tuple(lshape)


def _transfer(plan: _Plan, pg: dist.ProcessGroup, src_g: int, is_src: bool, timeout: Optional[timedelta],
              progress_seconds: float, t0: float) -> tuple[int, Any]:
    """Buckets sent, and the source's copies of host memory still running (None when none are): the host goes on
    to the post-hooks while they run, and waits for them before the load returns (agree.host_reads_wait)."""
    core = plan.core
    if core is None or core.num_buckets == 0:
        return 0, None
    total = plan.total

    def progress(done: int) -> None:  # the source only, from inside the transfer
        now = time.perf_counter()
        rate = done / max(now - t0, 1e-9)
        logger.info("load_full_state_dict: %.2f of %.2f GiB queued (%.0f%%), %.2f GB/s, ETA %.0f s", done / 2**30,
                    total / 2**30, 100 * done / total, rate / 1e9, (total - done) / rate if rate else 0.0)

    # Taken by the transfer; let go after it either way: it refers to the plan, which the post-hooks must be free
    # to let go (load_full_state_dict), and on an error its ring goes now, not with the traceback.
    prepared, plan.prepared = plan.prepared, None
    try:
        out = payload_broadcast(core, pg, src_g, timeout, progress if is_src else None, progress_seconds,
                                leave_host_reads=True, prepared=prepared)
    finally:
        prepared = None
    plan.ring_bytes, plan.host_ring_bytes, plan.host_batched_bytes = out[1], out[2], out[3]
    return core.num_buckets, out[4]


def _run_post_hooks(model: nn.Module, missing: list[str], unexpected: list[str], judgment: Any = None) -> None:
    """load_state_dict's post-hooks, in its order (children first), but for FSDP2's that would do nothing
    after the in-place writes (csrc/post_hooks.h). Where every hook is such, none runs (one C++ walk);
    else each is judged when its turn comes (an earlier hook may have replaced its parameter). judgment: that
    walk, begun while the plan was made (_judge_hooks), so that it does not run twice."""
    from torch.nn.modules.module import _IncompatibleKeys
    if judgment is not None:
        all_idle = judgment.verdict()
    else:  # not begun while planning (or set_extra_state ran since)
        all_idle = _C.post_hooks_idle(model)
    if all_idle:
        return

    def visit(m: nn.Module) -> None:
        for child in m._modules.values():
            if child is not None:
                visit(child)
        hooks = m._load_state_dict_post_hooks
        if hooks:
            keys = _IncompatibleKeys(missing, unexpected)
            for hook in hooks.values():
                if not _C.idle_fsdp_hook(m, hook):
                    hook(m, keys)

    visit(model)


#: Whether `hook`, registered on a module, is FSDP2's and would do nothing after an in-place load.
_idle_fsdp_hook = _C.idle_fsdp_hook

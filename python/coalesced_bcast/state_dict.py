"""load_full_state_dict: load a full state dict that one rank holds into a plain or FSDP2-sharded model
on every rank, streaming the source's bytes through a fixed ring of buckets.

Memory: every rank holds ``ring_depth`` device buckets of ``bucket_bytes``; the source, when its
tensors are on the CPU and the model on a GPU, also ``ring_depth`` pinned host buckets. Nothing the
size of a tensor is allocated anywhere: a tensor larger than a bucket is split across buckets, and
each rank copies out of each bucket only the bytes that fall into its own shard.

Streams (CUDA): the source fills bucket k on a copy stream (pageable tensors are first copied into a
pinned host bucket by a few CPU threads, pinned ones go straight to the device); the broadcast and
every rank's copy-out run on a comm stream. Events order the two streams and bound the host's run-ahead;
the ring is allocated once on the caller's stream, which waits for both streams at the end, so no
buffer is ever used on a stream it was not allocated on without an ordering (no record_stream).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import math
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .bits import as_int
from .sync import DEFAULT_BUCKET_BYTES, DEFAULT_RING_DEPTH, _group_src, _resolve_group, gc_paused

logger = logging.getLogger(__name__)

_EXTRA = getattr(nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")
#: A pinned source bucket with more pieces than this is packed on the host and sent with one copy:
#: a copy-engine transfer per small piece costs more in launches than the host memcpy.
_DIRECT_MAX_PIECES = 16
#: Host copies smaller than this are not worth handing to threads.
_THREAD_MIN_BYTES = 1 << 20
_META_CHUNK = 512 << 10  # metadata moves in pieces this size: small-pool device blocks only
_RECORD = 4096  # bytes per rank in the verdict all_gather: 3 int64, then a UTF-8 message
#: Debug switch to bisect a wrong GPU load (COALESCED_BCAST_LOAD_DEBUG=sync, or set here): synchronizes
#: the device after every stage of every bucket (rules stream ordering in or out).
_DEBUG: set[str] = set(filter(None, os.environ.get("COALESCED_BCAST_LOAD_DEBUG", "").split(",")))


class LoadStateDictError(RuntimeError):
    """Raised on every rank when any rank cannot load the source's state dict; no rank wrote anything."""


@dataclass(frozen=True)
class LoadStats:
    """What one load did on this rank; the counts of what was sent are the same on every rank."""

    keys: int  # state-dict keys loaded (tied names each count, extra states included)
    tensors: int  # distinct checkpoint tensors sent (keys sharing one tensor in the checkpoint count once)
    bytes: int  # checkpoint bytes sent, in the checkpoint's dtypes
    buckets: int
    cast_keys: int  # keys whose model dtype differs from the checkpoint's, cast on this rank's device
    missing_keys: tuple[str, ...]  # model keys absent from the checkpoint (left as they were)
    unexpected_keys: tuple[str, ...]  # checkpoint keys the model does not have (ignored)
    ring_bytes: int  # device bucket bytes held during the call (host bytes for a CPU model)
    host_ring_bytes: int  # pinned host bucket bytes (the source, for CPU tensors into a GPU model)
    seconds: float  # host wall time on this rank


@dataclass
class _Dest:
    """Where a checkpoint tensor lands on this rank: the local tensor and its box in the full tensor."""

    local: torch.Tensor
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    flat: Optional[torch.Tensor]  # local.view(-1) when the box is whole rows of a contiguous tensor
    f0: int  # the box's first element in the full tensor's row-major order (flat boxes only)
    f1: int


@dataclass
class _Unit:
    """One distinct checkpoint tensor: its place in the byte stream and its destinations here."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    es: int
    nbytes: int
    offset: int
    dests: list[_Dest]
    src: Optional[torch.Tensor] = None  # the source's tensor, on the source only
    src_bytes: Optional[torch.Tensor] = None  # its bytes as a flat uint8 view, when contiguous
    pinned: bool = False


@gc_paused
def load_full_state_dict(
    model: nn.Module,
    sd: Optional[Mapping[str, Any]],
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ring_depth: int = DEFAULT_RING_DEPTH,
    copy_threads: Optional[int] = None,
    progress_seconds: float = 5.0,
    timeout: Optional[Union[float, timedelta]] = None,
) -> LoadStats:
    """Load the source rank's full state dict ``sd`` into ``model`` on every rank, as
    ``model.load_state_dict(sd, strict)`` would on one process.

    Args:
        model: a plain module or an FSDP2 (``fully_shard``) model whose tensors have storage (after
            ``to_empty``); DTensor parameters and buffers may be ``Shard(d)`` and ``Replicate``
            over any mesh; each rank writes only its local shard.
        sd: on the source, a full state dict of plain tensors (CPU, pinned or pageable or mmap'ed,
            or on the model's GPU); on the other ranks ``None`` (anything passed there is ignored).
        src: the source's global rank.
        group: the process group (default: the world).
        strict: as in ``load_state_dict``: missing or unexpected keys raise on every rank.
        bucket_bytes: bytes per bucket (a multiple of 16, at least 4096); as in ``broadcast_tensors``.
        ring_depth: buckets in the ring; extra device memory is ``bucket_bytes * ring_depth``.
        copy_threads: CPU threads that copy pageable source tensors into pinned buckets (default:
            up to 8, the source only).
        progress_seconds: the source logs bytes, GB/s and ETA at this interval for longer loads.
        timeout: seconds (or a timedelta) for each bucket's broadcast; default: the group's.

    Keys are the model's ``state_dict()`` keys (persistent buffers only); a checkpoint value is cast
    to the model tensor's dtype on the device after transfer. Non-persistent buffers are not in a
    state dict and are left as they are; tied parameters receive the value of their last key, as
    with ``load_state_dict``. The model's load_state_dict post-hooks run afterwards (FSDP2 uses one);
    pre-hooks, which rewrite the incoming dict, do not. Any error (missing or unexpected keys under
    ``strict``, a shape mismatch, a bad value, a model that differs between ranks) is raised on every
    rank before any tensor is written. On CUDA the caller's current stream is made to wait for the
    load: the model can be used at once in stream order.
    """
    t0 = time.perf_counter()
    pg = _resolve_group(group)
    src_g = _group_src(pg, src)
    rank, is_src = dist.get_rank(), pg.rank() == src_g
    ctrl = _control_device(pg)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    with torch.no_grad():
        model_sd, extra_mods, error = None, {}, None
        try:
            model_sd = model.state_dict(keep_vars=True)  # FSDP2's pre-hook reshards first
            extra_mods = _extra_state_modules(model)
            device = _model_device(model_sd, extra_mods, pg)
        except Exception as e:  # reported through the agreement below, so no rank is left waiting
            error, device = f"{type(e).__name__}: {e}", ctrl
        meta, src_tensors = None, None
        if is_src:
            try:
                meta, src_tensors = _describe_source(sd, extra_mods, device, error, bucket_bytes, ring_depth, rank)
            except Exception as e:  # the others are already waiting for the metadata: tell them
                meta, src_tensors = dict(fatal=f"rank {rank}: {type(e).__name__}: {e}"), None
        meta = _broadcast_meta(meta, pg, src_g, ctrl)
        if meta["fatal"]:
            raise LoadStateDictError(f"load_full_state_dict: source rank {src} refused, so no rank loaded "
                                     f"anything: {meta['fatal']}")
        plan = _plan_local(model, model_sd, extra_mods, meta, src_tensors, strict, device, rank, error,
                           bucket_bytes, ring_depth, copy_threads if is_src else 1)
        _agree(plan, pg, src_g, ctrl, rank)
        try:
            buckets = _transfer(plan, pg, src_g, is_src, device, timeout, progress_seconds, t0)
        finally:
            plan.close()
        tensors, nbytes = len(plan.units), sum(u.nbytes for u in plan.units)
        plan.units = []  # FSDP2's post-hook may re-pad shards: let the old storage go
        del model_sd, src_tensors
        for obj, mod in plan.extras:
            mod.set_extra_state(obj)
        _run_post_hooks(model, list(plan.missing), list(plan.unexpected))
    stats = LoadStats(
        keys=plan.num_keys, tensors=tensors, bytes=nbytes, buckets=buckets,
        cast_keys=plan.cast_keys, missing_keys=tuple(plan.missing), unexpected_keys=tuple(plan.unexpected),
        ring_bytes=plan.ring_bytes, host_ring_bytes=plan.host_ring_bytes, seconds=time.perf_counter() - t0)
    if is_src:
        logger.info("load_full_state_dict: loaded %d keys (%d tensors, %.3f GiB, %d buckets, %d cast) in %.3f s, "
                    "%.2f GB/s", stats.keys, stats.tensors, stats.bytes / 2**30, stats.buckets, stats.cast_keys,
                    stats.seconds, stats.bytes / max(stats.seconds, 1e-9) / 1e9)
    return stats


# ---------------------------------------------------------------------------------------------------
# Agreement: the source describes its checkpoint, every rank plans against it, one verdict for all.


def _control_device(pg: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _extra_state_modules(model: nn.Module) -> dict[str, nn.Module]:
    """State-dict keys that hold a module's extra state, walked the way state_dict() walks."""
    out: dict[str, nn.Module] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            out[prefix + _EXTRA] = m
        for name, child in m._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return out


def _model_device(model_sd: Mapping[str, Any], extra: Mapping[str, nn.Module],
                  pg: dist.ProcessGroup) -> torch.device:
    devices = set()
    for k, v in model_sd.items():
        if k in extra or not isinstance(v, torch.Tensor):
            continue
        local = v._local_tensor if isinstance(v, DTensor) else v
        if local.is_meta:
            raise ValueError(f"'{k}' is on the meta device: materialize the model first "
                             f"(model.to_empty(device=...))")
        if local.numel():
            devices.add(local.device)
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are on several devices ({sorted(map(str, devices))}); "
                         f"load_full_state_dict needs them on one")
    device = devices.pop() if devices else _control_device(pg)
    backend = str(dist.get_backend(pg))
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"the model is on the CPU but the group's backend is {backend}: use a gloo group")
    return device


def _source_problem(v: Any, device: torch.device) -> Optional[str]:
    if not isinstance(v, torch.Tensor):
        return f"a {type(v).__name__}, not a tensor"
    if isinstance(v, DTensor):
        return "a DTensor: the source must hold a full state dict of plain tensors"
    if type(v) not in (torch.Tensor, nn.Parameter):
        return f"a tensor subclass ({type(v).__name__}), not a plain tensor"
    if v.layout != torch.strided:
        return f"a {v.layout} tensor; only dense tensors can be loaded"
    if v.is_meta:
        return "a meta tensor (it has no data)"
    if v.device.type != "cpu" and v.device != device:
        return f"on {v.device}, but the model is on {device}; use CPU tensors or the model's device"
    return None


def _describe_source(sd: Optional[Mapping[str, Any]], extra: Mapping[str, nn.Module], device: torch.device,
                     error: Optional[str], bucket_bytes: int, ring_depth: int,
                     rank: int) -> tuple[dict, list[Optional[torch.Tensor]]]:
    """The metadata every rank plans from: keys, dtypes, shapes, which keys share one tensor."""
    meta: dict[str, Any] = dict(fatal=None, keys=[], info=[], bucket_bytes=bucket_bytes, ring_depth=ring_depth)
    tensors: list[Optional[torch.Tensor]] = []
    if error is None and not isinstance(sd, Mapping):
        error = f"sd is {'None' if sd is None else 'a ' + type(sd).__name__} on the source; pass the full state dict"
    if error is None:
        error = _check_options(bucket_bytes, ring_depth)
    if error is not None:
        meta["fatal"] = f"rank {rank}: {error}"
        return meta, tensors
    seen: dict[tuple, int] = {}
    for i, (k, v) in enumerate(sd.items()):
        meta["keys"].append(k)
        tensors.append(None)
        if not isinstance(k, str):
            meta["fatal"] = f"rank {rank}: the state dict has a key that is not a string: {k!r}"
            return meta, []
        if k in extra:  # a module's extra state: any picklable object, sent with the metadata
            meta["info"].append(("x", v.detach().cpu() if isinstance(v, torch.Tensor) else v))
            continue
        problem = _source_problem(v, device)
        if problem:
            meta["info"].append(("bad", problem))
            continue
        canon = i
        if v.numel():
            ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype,
                     v.device, v.is_conj(), v.is_neg())
            canon = seen.setdefault(ident, i)
        meta["info"].append(("t", v.dtype, tuple(v.shape), canon))
        tensors[i] = v.detach()
    return meta, tensors


def _check_options(bucket_bytes: int, ring_depth: int) -> Optional[str]:
    if bucket_bytes < 4096 or bucket_bytes % 16:
        return f"bucket_bytes={bucket_bytes}: it must be a multiple of 16 and at least 4096"
    if ring_depth < 1:
        return f"ring_depth={ring_depth}: it must be at least 1"
    return None


def _broadcast_meta(meta: Optional[dict], pg: dist.ProcessGroup, src_g: int, ctrl: torch.device) -> dict:
    src = dist.get_global_rank(pg, src_g)
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL) if meta is not None else b""
    n = torch.tensor([len(blob)], dtype=torch.int64, device=ctrl)
    dist.broadcast(n, src, group=pg)
    total = int(n.item())
    host = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if meta is not None else torch.empty(total, dtype=torch.uint8)
    chunk = torch.empty(min(total, _META_CHUNK), dtype=torch.uint8, device=ctrl)
    for lo in range(0, total, _META_CHUNK):
        part = chunk[:min(_META_CHUNK, total - lo)]
        if meta is not None:
            part.copy_(host[lo:lo + part.numel()])
        dist.broadcast(part, src, group=pg)
        if meta is None:
            host[lo:lo + part.numel()].copy_(part)
    return meta if meta is not None else pickle.loads(host.numpy().tobytes())


class _Plan:
    """This rank's share of the load: what to send (source), where each byte lands, and the rings."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.units: list[_Unit] = []
        self.extras: list[tuple[Any, nn.Module]] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.num_keys = 0
        self.cast_keys = 0
        self.digest = 0
        self.total = 0
        self.bucket_bytes = 0
        self.ring_depth = 0
        self.depth = 0  # slots actually used: at most ring_depth, at most the number of buckets
        self.slot_bytes = 0
        self.host_src = False  # the source has CPU tensors to send
        self.ring: Optional[torch.Tensor] = None
        self.host_ring: Optional[torch.Tensor] = None
        self.ring_bytes = 0
        self.host_ring_bytes = 0
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.threads = 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.ring = self.host_ring = None


def _plan_local(model: nn.Module, model_sd: Optional[Mapping[str, Any]], extra: Mapping[str, nn.Module],
                meta: dict, src_tensors: Optional[list], strict: bool, device: torch.device, rank: int,
                error: Optional[str], bucket_bytes: int, ring_depth: int, copy_threads: Optional[int]) -> _Plan:
    plan = _Plan()
    try:
        if error is not None:
            plan.errors.append(error)
        else:
            _plan_keys(plan, model, model_sd, extra, meta, src_tensors, strict, device, rank, bucket_bytes, ring_depth)
        if not plan.errors:
            _plan_rings(plan, device, src_tensors is not None, copy_threads)
    except Exception as e:  # a bug or an allocation failure must reach the other ranks, not strand them
        plan.errors.append(f"{type(e).__name__}: {e}")
    if plan.errors:
        plan.errors.insert(0, f"Error(s) in loading state_dict for {type(model).__name__} on rank {rank}:")
    return plan


def _plan_keys(plan: _Plan, model: nn.Module, model_sd: Mapping[str, Any], extra: Mapping[str, nn.Module], meta: dict,
               src_tensors: Optional[list], strict: bool, device: torch.device, rank: int,
               bucket_bytes: int, ring_depth: int) -> None:
    if (bucket_bytes, ring_depth) != (meta["bucket_bytes"], meta["ring_depth"]):
        plan.errors.append(f"bucket_bytes={bucket_bytes}, ring_depth={ring_depth} on rank {rank}, but the source "
                           f"uses {meta['bucket_bytes']}, {meta['ring_depth']}; pass the same options everywhere")
        return
    plan.bucket_bytes, plan.ring_depth = bucket_bytes, ring_depth
    index = {k: i for i, k in enumerate(meta["keys"])}
    info = meta["info"]
    plan.missing = [k for k in model_sd if k not in index]
    plan.unexpected = [k for k in meta["keys"] if k not in model_sd]
    if strict and plan.missing:
        plan.errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.missing) + ".")
    if strict and plan.unexpected:
        plan.errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.unexpected) + ".")
    owned = _owned_tensors(model)
    layouts: dict = {}  # per (mesh, placements): what _dtensor_box needs, looked up once
    units: dict[int, _Unit] = {}
    load_keys = []
    for k, v in model_sd.items():
        i = index.get(k)
        if i is None:
            continue
        load_keys.append(k)
        entry = info[i]
        if k in extra:
            if entry[0] != "x":
                plan.errors.append(f'"{k}": extra state on rank {rank}, but not on the source (models differ)')
            else:
                plan.extras.append((entry[1], extra[k]))
            continue
        if entry[0] == "bad":
            plan.errors.append(f'While copying the parameter named "{k}", the source\'s value is {entry[1]}.')
            continue
        if entry[0] != "t":
            plan.errors.append(f'"{k}": extra state on the source, but a tensor on rank {rank} (models differ)')
            continue
        _, dtype, shape, canon = entry
        if not isinstance(v, torch.Tensor) or id(v) not in owned:
            plan.errors.append(f'"{k}": the model\'s state_dict() value is not one of its parameters or buffers '
                               f'(a state_dict hook made a copy?), so it cannot be loaded in place.')
            continue
        if tuple(v.shape) != shape:
            plan.errors.append(f"size mismatch for {k}: copying a param with shape {torch.Size(shape)} from "
                               f"checkpoint, the shape in current model is {v.shape}.")
            continue
        dest = _make_dest(k, v, shape, rank, plan.errors, layouts)
        if v.dtype != dtype:
            plan.cast_keys += 1
        unit = units.get(canon)
        if unit is None:
            es = dtype.itemsize
            unit = _Unit(dtype=dtype, shape=shape, es=es, nbytes=math.prod(shape) * es, offset=0, dests=[])
            units[canon] = unit
            if src_tensors is not None:
                unit.src = src_tensors[canon]
        if dest is not None:
            unit.dests.append(dest)
    plan.num_keys = len(load_keys)
    plan.digest = _digest(load_keys, extra)
    offset = 0
    for unit in units.values():  # model order: ties on a rank are written in load_state_dict's order
        if unit.nbytes == 0:
            continue
        offset = -(-offset // unit.es) * unit.es  # element-aligned, so a bucket slice views as the dtype
        unit.offset = offset
        offset += unit.nbytes
        plan.units.append(unit)
    plan.total = offset


def _owned_tensors(model: nn.Module) -> set[int]:
    """state_dict(keep_vars=True) returns the registered objects themselves, unless a hook copied one."""
    owned = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
    owned |= {id(b) for _, b in model.named_buffers(remove_duplicate=False)}
    return owned


def _make_dest(key: str, v: torch.Tensor, shape: tuple[int, ...], rank: int, errors: list[str],
               layouts: dict) -> Optional[_Dest]:
    if isinstance(v, DTensor):
        box = _dtensor_box(key, v, shape, rank, errors, layouts)
        if box is None:
            return None
        lo, hi = box
        local = v._local_tensor.detach()
    else:
        lo, hi, local = (0,) * len(shape), shape, v.detach()
    if local.numel() == 0:
        return None
    flat, f0, f1 = None, 0, 0
    whole_rows = all(lo[d] == 0 and hi[d] == shape[d] for d in range(1, len(shape)))
    if whole_rows and local.is_contiguous() and not local.is_conj() and not local.is_neg():
        inner = math.prod(shape[1:])
        flat = local.view(-1)
        f0, f1 = (lo[0] * inner, hi[0] * inner) if shape else (0, 1)
    return _Dest(local=local, lo=tuple(lo), hi=tuple(hi), flat=flat, f0=f0, f1=f1)


def _dtensor_box(key: str, v: DTensor, shape: tuple[int, ...], rank: int, errors: list[str],
                 layouts: dict) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The global box [lo, hi) this rank's local tensor holds; None when it holds nothing.

    ``layouts`` memoizes per (mesh, placements) the checks and mesh lookups, the same for every
    tensor of an FSDP2 model: at 16k tensors they cost more than the boxes themselves."""
    mesh, placements = v.device_mesh, v.placements
    layout = layouts.get((id(mesh), placements))
    if layout is None:
        bad = [p for p in placements if type(p) is not Shard and type(p) is not Replicate]
        layout = (f"placement {bad[0]} is not supported (only Shard(dim) and Replicate)" if bad else None,
                  mesh.get_coordinate(), mesh.ndim, mesh.size(0) if mesh.ndim == 1 else 0)
        layouts[(id(mesh), placements)] = layout
    problem, coord, ndim, mesh_size = layout
    if problem is not None:
        errors.append(f'"{key}": {problem}')
        return None
    if coord is None:
        return None
    lo, hi = [0] * len(shape), list(shape)
    if ndim == 1:
        p = placements[0]
        if type(p) is Shard:  # torch.chunk's split, as DTensor's Shard uses: ceil-sized chunks, empty tails
            d, n = p.dim % len(shape), shape[p.dim % len(shape)]
            chunk = -(-n // mesh_size)
            lo[d] = min(coord[0] * chunk, n)
            hi[d] = min(lo[d] + chunk, n)
    else:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        lshape, off = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
        lo, hi = list(off), [o + s for o, s in zip(off, lshape)]
    local_shape = tuple(h - l for l, h in zip(lo, hi))
    if local_shape != tuple(v._local_tensor.shape):
        errors.append(f'"{key}": rank {rank} holds a local shard of shape {tuple(v._local_tensor.shape)}, but its '
                      f'placements {placements} on a mesh of shape {tuple(mesh.shape)} give {local_shape}')
        return None
    return tuple(lo), tuple(hi)


def _digest(load_keys: list[str], extra: Mapping[str, nn.Module]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for k in load_keys:
        h.update(k.encode())
        h.update(b"\1" if k in extra else b"\0")
    return int.from_bytes(h.digest(), "little", signed=True)


def _plan_rings(plan: _Plan, device: torch.device, is_src: bool, copy_threads: Optional[int]) -> None:
    if not plan.units:
        return
    nbuckets = -(-plan.total // plan.bucket_bytes)
    plan.depth = min(plan.ring_depth, nbuckets)
    plan.slot_bytes = plan.total if nbuckets == 1 else plan.bucket_bytes
    plan.ring = torch.empty(plan.depth * plan.slot_bytes, dtype=torch.uint8, device=device)
    plan.ring_bytes = plan.ring.numel()
    if not is_src:
        return
    for u in plan.units:
        t = u.src
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            u.src_bytes = t.reshape(-1).view(torch.uint8)
        if device.type == "cuda" and t.device.type == "cpu":
            u.pinned = t.is_pinned()
    plan.host_src = any(u.src.device.type == "cpu" for u in plan.units)
    if device.type == "cuda" and plan.host_src:
        plan.host_ring = torch.empty(plan.depth * plan.slot_bytes, dtype=torch.uint8, pin_memory=True)
        plan.host_ring_bytes = plan.host_ring.numel()
    if copy_threads is None:
        copy_threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    plan.threads = max(1, int(copy_threads))
    if plan.threads > 1 and plan.host_src:
        plan.pool = concurrent.futures.ThreadPoolExecutor(plan.threads, thread_name_prefix="coalesced_bcast_copy")


def _agree(plan: _Plan, pg: dist.ProcessGroup, src_g: int, ctrl: torch.device, rank: int) -> None:
    """One all_gather of a small record: every rank raises the same verdict, before any write."""
    msg = "\n\t".join(plan.errors)
    rec = torch.zeros(_RECORD, dtype=torch.uint8)
    rec[:24].view(torch.int64).copy_(torch.tensor([1 if msg else 0, plan.digest, plan.num_keys]))
    raw = msg.encode()[: _RECORD - 24]
    if raw:
        rec[24:24 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty(_RECORD, dtype=torch.uint8, device=ctrl) for _ in range(pg.size())]
    dist.all_gather(out, rec.to(ctrl), group=pg)
    table = torch.stack(out).cpu()
    heads = table[:, :24].contiguous().view(torch.int64).tolist()
    ranks = dist.get_process_group_ranks(pg)
    if msg:
        plan.close()
        raise LoadStateDictError(f"load_full_state_dict: no rank loaded anything. {msg}")
    for r, (status, digest, n) in enumerate(heads):
        if status:
            plan.close()
            text = bytes(table[r, 24:].tolist()).rstrip(b"\0").decode(errors="replace")
            cut = " [...]" if len(text.encode()) >= _RECORD - 24 - 4 else ""
            raise LoadStateDictError(f"load_full_state_dict: rank {ranks[r]} refused, so no rank loaded anything. "
                                     f"{text}{cut}")
    src_digest, src_n = heads[src_g][1], heads[src_g][2]
    for r, (_, digest, n) in enumerate(heads):
        if (digest, n) != (src_digest, src_n):
            plan.close()
            raise LoadStateDictError(
                f"load_full_state_dict: rank {ranks[r]} would load {n} keys of the checkpoint and source rank "
                f"{ranks[src_g]} {src_n} (or the same number of different keys): the models differ, so no rank "
                f"loaded anything")


# ---------------------------------------------------------------------------------------------------
# Transfer: bucket by bucket through the ring.


def _range_boxes(shape: tuple[int, ...], e0: int, e1: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [e0, e1) of a row-major tensor as at most 2*ndim-1 boxes [lo, hi), each contiguous."""
    if e0 >= e1:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(e0, inner)
    r1, c1 = divmod(e1, inner)
    rest = tuple(shape[1:])
    if r0 == r1:
        return [((r0,) + lo, (r0 + 1,) + hi) for lo, hi in _range_boxes(rest, c0, c1)]
    out = []
    if c0:
        out += [((r0,) + lo, (r0 + 1,) + hi) for lo, hi in _range_boxes(rest, c0, inner)]
        r0 += 1
    if r0 < r1:
        out.append(((r0,) + (0,) * len(rest), (r1,) + rest))
    if c1:
        out += [((r1,) + lo, (r1 + 1,) + hi) for lo, hi in _range_boxes(rest, 0, c1)]
    return out


def _ravel(idx: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(idx, shape):
        flat = flat * n + i
    return flat


def _box_pairs(buf: torch.Tensor, unit: _Unit, ea: int, ec: int,
               other: torch.Tensor, olo: tuple[int, ...], ohi: tuple[int, ...]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(view of buf, view of other) for the elements [ea, ec) of unit that lie in other's box [olo, ohi).

    buf holds those elements back to back, as bytes of unit.dtype; other holds the box, any strides.
    """
    for lo, hi in _range_boxes(unit.shape, ea, ec):
        ilo = tuple(max(a, b) for a, b in zip(lo, olo))
        ihi = tuple(min(a, b) for a, b in zip(hi, ohi))
        if any(a >= b for a, b in zip(ilo, ihi)):
            continue
        start = (_ravel(lo, unit.shape) - ea) * unit.es
        n = math.prod(h - l for l, h in zip(lo, hi)) * unit.es
        box = buf[start:start + n].view(unit.dtype).view(tuple(h - l for l, h in zip(lo, hi)))
        box = box[tuple(slice(a - l, b - l) for a, b, l in zip(ilo, ihi, lo))]
        yield box, other[tuple(slice(a - l, b - l) for a, b, l in zip(ilo, ihi, olo))]


def _buckets(units: list[_Unit], total: int, size: int) -> Iterator[tuple[int, int, list]]:
    """(start, bytes, pieces) per bucket; a piece is (unit, first byte, end byte, offset in the bucket)."""
    i = 0
    for lo in range(0, total, size):
        hi = min(lo + size, total)
        while i < len(units) and units[i].offset + units[i].nbytes <= lo:
            i += 1
        pieces, j = [], i
        while j < len(units) and units[j].offset < hi:
            u = units[j]
            s, e = max(u.offset, lo), min(u.offset + u.nbytes, hi)
            if s < e:
                pieces.append((u, s - u.offset, e - u.offset, s - lo))
            j += 1
        yield lo, hi - lo, pieces


def _copy_out(slot: torch.Tensor, pieces: list) -> None:
    """Copy each piece's part of this rank's tensors out of the bucket (casting where dtypes differ)."""
    dsts, srcs = [], []
    for u, a, c, o in pieces:
        ea, ec = a // u.es, c // u.es
        for d in u.dests:
            if d.flat is not None:
                x, y = max(ea, d.f0), min(ec, d.f1)
                if x >= y:
                    continue
                dsts.append(d.flat[x - d.f0:y - d.f0])
                srcs.append(slot[o + (x - ea) * u.es:o + (y - ea) * u.es].view(u.dtype))
            else:
                for s, t in _box_pairs(slot[o:o + c - a], u, ea, ec, d.local, d.lo, d.hi):
                    dsts.append(t)
                    srcs.append(s)
    # Same-dtype pieces are copied as integers: CUDA's _foreach_copy_ computes in float for bf16/fp16
    # and turns every NaN payload into 0x7FFF (seen on H200, torch 2.11), which is not bitwise.
    # Casts go one by one through copy_, exactly as load_state_dict casts.
    same = [(as_int(d), as_int(s)) for d, s in zip(dsts, srcs) if d.dtype == s.dtype]
    if len(same) > 1:
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
    else:
        for d, s in same:
            d.copy_(s)
    for d, s in zip(dsts, srcs):
        if d.dtype != s.dtype:
            d.copy_(s)



def _pack_tasks(buf: torch.Tensor, pieces: list) -> list:
    """Copies that fill buf from the source's tensors: (offset, byte view) or (offset, nbytes, box pairs)."""
    tasks = []
    for u, a, c, o in pieces:
        if u.src_bytes is not None:
            tasks.append((o, u.src_bytes[a:c]))
        else:
            ea, ec = a // u.es, c // u.es
            full = (0,) * len(u.shape)
            tasks.append((o, c - a, list(_box_pairs(buf[o:o + c - a], u, ea, ec, u.src, full, u.shape))))
    return tasks


def _run_tasks(buf: torch.Tensor, tasks: list, non_blocking: bool = False) -> None:
    """Runs of adjacent byte views on buf's device go in one torch.cat; strided pieces copy box by box."""
    run: list[torch.Tensor] = []
    start = end = 0

    def flush() -> None:
        if len(run) == 1:
            buf[start:end].copy_(run[0], non_blocking=non_blocking)
        elif run:
            torch.cat(run, out=buf[start:end])

    for task in tasks:
        if len(task) == 2:
            o, view = task
            # only device views are joined: torch.cat cannot mix a host view into a device out=
            if run and o == end and view.device == buf.device and run[0].device == buf.device:
                run.append(view)
                end += view.numel()
            else:
                flush()
                run, start, end = [view], o, o + view.numel()
        else:
            flush()
            run = []
            for dst, srcv in task[2]:
                dst.copy_(srcv, non_blocking=non_blocking)
    flush()


def _split_tasks(tasks: list, parts: int) -> list[list]:
    """About equal bytes per part; large byte views are cut, strided pieces kept whole."""
    total = sum(t[1].numel() if len(t) == 2 else t[1] for t in tasks)
    if parts <= 1 or total < _THREAD_MIN_BYTES:
        return [tasks]
    per = -(-total // parts)
    groups: list[list] = [[]]
    filled = 0
    for task in tasks:
        if len(task) == 3:
            groups[-1].append(task)
            filled += task[1]
        else:
            o, view = task
            pos, n = 0, view.numel()
            while pos < n:
                take = min(n - pos, max(per - filled, 1))
                groups[-1].append((o + pos, view[pos:pos + take]))
                pos += take
                filled += take
                if filled >= per:
                    groups.append([])
                    filled = 0
        if filled >= per:
            groups.append([])
            filled = 0
    return [g for g in groups if g]


class _Lanes:
    """The copy and comm streams and the per-slot events on CUDA; plain calls on the CPU."""

    def __init__(self, device: torch.device, depth: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.caller = torch.cuda.current_stream(device)
            self.copy = torch.cuda.Stream(device)
            self.comm = torch.cuda.Stream(device)
            self.copy.wait_stream(self.caller)  # the model's tensors and the ring come from the caller's stream
            self.comm.wait_stream(self.caller)
            self.filled = [torch.cuda.Event() for _ in range(depth)]
            # One per bucket modulo two laps: the copy stream waits for the slot's previous user (one
            # lap back) while the host blocks only on the bucket two laps back.
            self.freed = [torch.cuda.Event() for _ in range(2 * depth)]
            self.host_freed = [torch.cuda.Event() for _ in range(depth)]

    def on(self, stream_name: str):
        return torch.cuda.stream(getattr(self, stream_name)) if self.cuda else contextlib.nullcontext()

    def finish(self, wait_host_copies: bool) -> None:
        if self.cuda:
            self.caller.wait_stream(self.comm)
            self.caller.wait_stream(self.copy)
            if wait_host_copies:  # the source's CPU tensors may be changed or freed once we return
                self.copy.synchronize()


def _bcast(t: torch.Tensor, pg: dist.ProcessGroup, src_g: int, timeout: Optional[timedelta]) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src_g
    opts.rootTensor = 0
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False  # NCCL (torch >= 2.8) then runs on the current stream: our comm stream
    if timeout is not None:
        opts.timeout = timeout
    work = pg.broadcast([t], opts)
    if work is not None:
        work.wait()


def _transfer(plan: _Plan, pg: dist.ProcessGroup, src_g: int, is_src: bool, device: torch.device,
              timeout: Optional[timedelta], progress_seconds: float, t0: float) -> int:
    if not plan.units:
        return 0
    size, depth = plan.slot_bytes, plan.depth
    lanes = _Lanes(device, depth)
    buckets = list(_buckets(plan.units, plan.total, size))
    pending: dict[int, list[concurrent.futures.Future]] = {}
    staged = [False] * len(buckets)  # CUDA source: pack this bucket's CPU pieces on the host first
    if is_src and plan.host_ring is not None:
        for b, (_, _, pieces) in enumerate(buckets):
            host = [p for p in pieces if p[0].src.device.type == "cpu"]
            staged[b] = bool(host) and (len(host) > _DIRECT_MAX_PIECES
                                        or any(not p[0].pinned or p[0].src_bytes is None for p in host))

    def submit(b: int) -> None:
        """Start the CPU copies of bucket b (into its pinned slot, or its slot of a CPU ring) on the threads."""
        _, used, pieces = buckets[b]
        k = b % depth
        if lanes.cuda:
            pending[b] = []
            if not staged[b]:
                return
            lanes.host_freed[k].synchronize()  # the H2D copy that last read this pinned slot is done
            buf = plan.host_ring[k * size:k * size + used]
            pieces = [p for p in pieces if p[0].src.device.type == "cpu"]
        else:
            buf = plan.ring[k * size:k * size + used]
        groups = _split_tasks(_pack_tasks(buf, pieces), plan.threads if plan.pool is not None else 1)
        if plan.pool is None or len(groups) == 1:
            for g in groups:
                _run_tasks(buf, g)
            pending[b] = []
        else:
            pending[b] = [plan.pool.submit(_run_tasks, buf, g) for g in groups]

    progress = _Progress(plan.total, progress_seconds, t0)
    for b, (lo, used, pieces) in enumerate(buckets):
        k = b % depth
        slot = plan.ring[k * size:k * size + used]
        if lanes.cuda:
            lanes.freed[b % (2 * depth)].synchronize()  # bounds the host's run-ahead to two ring laps
        if is_src:
            if b not in pending:
                submit(b)
            if depth > 1 and b + 1 < len(buckets):
                submit(b + 1)  # the next bucket's CPU copies overlap this bucket's transfer
            for f in pending.pop(b):
                f.result()
            if lanes.cuda:
                with lanes.on("copy"):
                    lanes.copy.wait_event(lanes.freed[(b - depth) % (2 * depth)])  # slot k's last reader
                    if staged[b]:
                        slot.copy_(plan.host_ring[k * size:k * size + used], non_blocking=True)
                        lanes.host_freed[k].record(lanes.copy)
                        dev_pieces = [p for p in pieces if p[0].src.device.type != "cpu"]
                    else:
                        dev_pieces = pieces  # pinned byte views go straight to the device, piece by piece
                    _run_tasks(slot, _pack_tasks(slot, dev_pieces), non_blocking=True)
                    lanes.filled[k].record(lanes.copy)
                if "sync" in _DEBUG:
                    torch.cuda.synchronize(device)
            progress.update(lo + used - (2 * depth * size if lanes.cuda else 0))  # CUDA: up to two laps queued
        with lanes.on("comm"):
            if lanes.cuda and is_src:
                lanes.comm.wait_event(lanes.filled[k])
            _bcast(slot, pg, src_g, timeout)
            if "sync" in _DEBUG and lanes.cuda:
                torch.cuda.synchronize(device)
            _copy_out(slot, pieces)
            if lanes.cuda:
                lanes.freed[b % (2 * depth)].record(lanes.comm)
                if "sync" in _DEBUG:
                    torch.cuda.synchronize(device)
    lanes.finish(wait_host_copies=is_src and plan.host_src)
    return len(buckets)


class _Progress:
    def __init__(self, total: int, every: float, t0: float) -> None:
        self.total, self.every, self.t0 = total, every, t0
        self.next = t0 + every

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now < self.next or done <= 0:
            return
        self.next = now + self.every
        rate = done / (now - self.t0)
        logger.info("load_full_state_dict: %.2f of %.2f GiB (%.0f%%), %.2f GB/s, ETA %.0f s", done / 2**30,
                    self.total / 2**30, 100 * done / self.total, rate / 1e9, (self.total - done) / rate)


def _run_post_hooks(model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """load_state_dict's post-hooks, in its order (children first); FSDP2 re-pads its shards in one."""
    from torch.nn.modules.module import _IncompatibleKeys

    def visit(m: nn.Module) -> None:
        for child in m._modules.values():
            if child is not None:
                visit(child)
        keys = _IncompatibleKeys(missing, unexpected)
        for hook in m._load_state_dict_post_hooks.values():
            hook(m, keys)

    visit(model)

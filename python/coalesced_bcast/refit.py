"""Weight refit: a trainer's weights to inference processes in another process group, every step.

The trainer side (:class:`RefitSender`, on every trainer rank) streams the named tensors in the
engine's dtype, through a ring of buckets, without any rank holding a full tensor: for a DTensor
sharded by rows (FSDP2's ``Shard(0)``) each bucket's rows are packed and cast on the rank that holds
them, gathered over the trainer group into the sending rank's ring slot and broadcast over the refit
group. The engine side (:class:`RefitReceiver`) writes them straight into its tensors, or hands each
bucket to a callback as ``(name, view)`` pairs while the slot is valid. Both sides keep their plans:
each refit after the first costs a few small messages (the agreement) and the transfer.

Extra device memory on every process is its ring, whatever the largest tensor: the sender
``ring_depth`` bucket slots plus as many gather slots (a trainer world's chunks), the other trainer
ranks ``ring_depth`` chunks, the receivers ``ring_depth`` bucket slots; all of it is returned when a
call ends.
"""
from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C, _dtensor
from ._refit_common import RefitBatch, RefitStats, _digest, _Hasher, init_refit_group  # noqa: F401 (re-exported)
from ._util import _CASTABLE, _dtype_code, _dtype_of_code, _int64_table, _module_slots, gc_paused
from .agree import (OK, REFUSED, AgreementError, CollectiveError, Record, Verdict, as_timedelta, broadcast,
                    broadcast_object, broadcast_record, control_device, verdict)
from .verify import VerifyError

logger = logging.getLogger(__name__)

#: Bucket bytes of a refit: larger than a sync's, as a refit moves the whole model every step and a
#: bucket's broadcast runs closer to the link's speed the larger it is.
DEFAULT_REFIT_BUCKET_BYTES = 64 << 20
DEFAULT_REFIT_RING_DEPTH = 3

_FLAG_VERIFY = 1  # the sender's record's count: the receivers verify
_W = 2 + 8  # units table width: dtype, ndim, sizes


def _refusal(v: Verdict, label: Callable[[int], str]) -> Optional[str]:
    """The first refusal of a verdict, in words, or None."""
    refused = v.refused()
    return f"{label(refused[0])} refused: {refused[1]}" if refused is not None else None


class RefitSender:
    """The trainer side of a refit: every trainer rank makes one and calls :meth:`send` each step.

    named_tensors: the weights: a module (its ``named_parameters()``; each send then also checks that
      every parameter is still the object the plan was made with, so that one replaced by
      ``load_state_dict(assign=True)`` is refused, or replanned with ``replan=True``, rather than its old
      storage sent), or ``(name, tensor)`` pairs (``named_parameters()``, a state dict); the same names in
      the same order on every trainer rank. A tensor is either a DTensor on a 1-D mesh,
      sharded by rows (``Shard(0)``, as FSDP2 shards) or replicated, or a plain tensor that the sending
      rank holds whole. Local shards must be contiguous: they are read in place, never copied whole.
    refit_group: the group joining the sending rank to the engines (see :func:`init_refit_group`), on
      the sending rank; None on the other trainer ranks.
    src: the sending rank's rank in the refit group. sender_rank: its rank in the trainer group. When no
      tensor is sharded and no trainer_group is given, every trainer rank holds the whole state: the rank
      given the refit group sends it, and on the others (refit_group None) send() does nothing.
    trainer_group: the group the shards are gathered over; default the DTensors' mesh group (none when
      no tensor is sharded).
    dtype: the wire's dtype (what the engine takes): None keeps each tensor's; a dtype casts every
      floating-point tensor to it (fp32 master weights to bf16); a callable ``(name, tensor) -> dtype``
      decides per tensor. Casts happen in the pack kernel, as torch's own ``copy_`` casts.
    bucket_bytes, ring_depth: the ring (``DEFAULT_REFIT_*``); the receivers follow the sender's bucket size.
    direct: a bucket whose bytes already lie back to back in one storage of the sending rank is broadcast
      from that memory, with no copy into the ring (True, the default); False sends every bucket through
      the ring, never from the tensors' own memory.
    """

    def __init__(self, named_tensors: Union[nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                 refit_group: Optional[dist.ProcessGroup], *, src: int = 0, sender_rank: int = 0,
                 trainer_group: Optional[dist.ProcessGroup] = None,
                 dtype: Union[None, torch.dtype, Callable[[str, torch.Tensor], torch.dtype]] = None,
                 bucket_bytes: int = DEFAULT_REFIT_BUCKET_BYTES, ring_depth: int = DEFAULT_REFIT_RING_DEPTH,
                 direct: bool = True):
        self._module = named_tensors if isinstance(named_tensors, nn.Module) else None
        self._slots: Optional[tuple] = None  # a module's (owners, keys, parameters): checked on every send
        if self._module is not None:
            self._read_module()
        else:
            items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
            self.names = [n for n, _ in items]
            self._tensors = [t for _, t in items]
        self.refit_group, self.src, self.sender_rank = refit_group, src, sender_rank
        self._trainer_arg, self._dtype = trainer_group, dtype
        self.bucket_bytes, self.ring_depth, self.direct = bucket_bytes, ring_depth, bool(direct)
        self._sends = 0
        self._build()

    # -- planning ------------------------------------------------------------------------------------

    def _build(self) -> None:
        DTensor, _, Shard = _dtensor.classes()
        self._plan, self._error, self._views = None, None, None
        # The trainer group first, whatever else fails: every trainer rank must take part in the agreement.
        self.trainer_group = self._trainer_arg or next(
            (t.device_mesh.get_group() for t in self._tensors if isinstance(t, DTensor) and t.device_mesh.ndim == 1
             and any(isinstance(p, Shard) for p in t.placements)), None)
        self._trainer_rank = self.trainer_group.rank() if self.trainer_group is not None else 0
        self._trainer_world = self.trainer_group.size() if self.trainer_group is not None else 1
        self.units = torch.zeros((0, _W), dtype=torch.int64)
        self.digest = 0
        # Nothing sharded and no trainer group: every trainer rank holds the whole state, and the one given
        # the refit group sends it; the others take no part (their send() returns at once).
        self._idle = self.trainer_group is None and self.refit_group is None
        self._is_sender = not self._idle if self.trainer_group is None else self._trainer_rank == self.sender_rank
        if self._idle:
            return
        try:
            self._plan_local()
        except (TypeError, ValueError, RuntimeError) as e:
            self._error = str(e)

    def _read_module(self) -> None:
        """named_parameters(), with the dicts that hold them: send() checks each still holds its parameter."""
        self.names = []
        self._slots = _module_slots(self._module, include_buffers=False, dedupe=True, names=self.names)
        self._tensors = self._slots[2]

    def _replaced(self) -> Optional[str]:
        """Of a module's parameters, the first that another object has replaced since the plan was made."""
        if self._slots is None:
            return None
        i = _C.first_replaced(*self._slots)
        if i < 0:
            return None
        return (f"tensor {i} ('{self.names[i]}') on trainer rank {self._trainer_rank} was replaced by another object "
                f"since the plan was made (load_state_dict(assign=True), a parameter assigned anew)")

    def _wire_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        d = self._dtype
        if d is None:
            return t.dtype
        if callable(d) and not isinstance(d, torch.dtype):
            return d(name, t)
        return d if t.dtype.is_floating_point else t.dtype

    def _plan_local(self) -> None:
        DTensor, Replicate, Shard = _dtensor.classes()
        rows, locals_, modes = [], [], []
        mesh_group = None
        device = None
        for i, (name, t) in enumerate(zip(self.names, self._tensors)):
            label = f"tensor {i} ('{name}')"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{label} is a {type(t).__name__}, not a tensor")
            mode, local = 0, t
            if isinstance(t, DTensor):
                mesh, placements = t.device_mesh, t.placements
                if mesh.ndim != 1:
                    raise ValueError(f"{label} is a DTensor on a {mesh.ndim}-D mesh; a refit takes 1-D meshes "
                                     f"(Shard(0) or Replicate)")
                p = placements[0]
                local = t._local_tensor
                if isinstance(p, Shard) and p.dim == 0:
                    mode = 1
                    group = mesh.get_group()
                    if mesh_group is None:
                        mesh_group = group
                    elif group is not mesh_group:
                        raise ValueError(f"{label} is sharded over another mesh than the tensors before it")
                elif not isinstance(p, Replicate):
                    raise ValueError(f"{label} is a DTensor placed {p}; a refit takes Shard(0) or Replicate")
            wire = self._wire_dtype(name, t)
            if wire != t.dtype and (wire not in _CASTABLE or t.dtype not in _CASTABLE):
                raise ValueError(f"{label} is {t.dtype} and cannot be sent as {wire}: only real dtypes and bool "
                                 f"are cast")
            if t.dim() > 8:
                raise ValueError(f"{label} has {t.dim()} dims; at most 8 are supported")
            if device is None and local.numel() > 0:
                device = local.device
            rows.append([_dtype_code(wire), t.dim(), *t.shape, *([0] * (8 - t.dim()))])
            locals_.append(local)
            modes.append(mode)
        if mesh_group is not None and mesh_group is not self.trainer_group and \
                dist.get_process_group_ranks(mesh_group) != dist.get_process_group_ranks(self.trainer_group):
            raise ValueError("the DTensors' mesh group is not the trainer_group given")
        world, rank = self._trainer_world, self._trainer_rank
        self.units = _int64_table(rows, _W)
        self.digest = _digest(self.names, self.units.numpy().tobytes(), self.bucket_bytes)
        self._trainer_digest = _digest(self.digest, modes, world, self.sender_rank)
        device = device or torch.device("cpu")
        # Tensors this rank holds no part of go in as undefined: the plan reads none of them.
        sender = self.sender_rank if self.trainer_group is not None else 0  # with no trainer group: this rank
        self._plan = _C.refit_plan(self.units, locals_, modes, rank, world, sender, self.bucket_bytes,
                                   self.ring_depth, rank, device, self.names, direct=self.direct)

    # -- the step ------------------------------------------------------------------------------------

    def _trainer_label(self, r: int) -> str:
        return f"trainer rank {r}"

    def _refit_label(self, r: int) -> str:
        return f"refit rank {r} (the sender)" if r == self.src else f"refit rank {r}"

    @gc_paused
    def send(self, *, timeout: Optional[Union[float, timedelta]] = None, verify: bool = False,
             replan: bool = False) -> RefitStats:
        """Stream the weights to the refit group's other ranks: every trainer rank calls it.

        Before any byte moves, the trainer ranks and the receivers agree: a tensor that moved or changed
        shape or dtype since the plan was made (or, with ``replan=True``, a plan the receivers cannot
        take) raises the same AgreementError on every rank. verify: afterwards, hash what every receiver
        holds and compare with the sender's bytes (VerifyError on a difference).
        """
        t0 = time.perf_counter()
        if self._idle:
            return RefitStats(tensors=len(self.names), bytes=0, buckets=0, ring_bytes=0, seconds=0.0, agree_seconds=0.0,
                              transfer_seconds=0.0, planned=False, verified=False)
        timeout = as_timedelta(timeout)
        planned = False
        error = self._error
        changed = self._replaced() if error is None else None
        if error is None and not changed:
            changed = self._plan.check_unchanged()
        if (changed or error) and replan:  # a plan that failed to build is tried again too
            if self._module is not None:
                self._read_module()
            self._build()
            planned, error = True, self._error
        elif changed:
            error = f"{changed}; make a new RefitSender or send(replan=True)"
        planned = planned or self._sends == 0
        self._sends += 1
        self._agree(error, timeout, verify)
        t_agreed = time.perf_counter()
        hasher = None
        if verify and self._is_sender:
            if self._views is None:
                self._views = _C.SlotViews(self.units, _C.bucket_units(self.units, self.bucket_bytes, True))
            hasher = _Hasher(self._views)
        try:
            seconds, ring = self._plan.refit_send(self.trainer_group, self.refit_group if self._is_sender else None,
                                                  self.src, timeout.total_seconds() if timeout else 0.0, hasher)
        except RuntimeError as e:
            raise CollectiveError(f"coalesced_bcast: the refit transfer failed on trainer rank {self._trainer_rank}: "
                                  f"{e}") from e
        if verify:
            self._verify(hasher, timeout)
        stats = RefitStats(tensors=len(self.names), bytes=self._plan.total_bytes, buckets=self._plan.num_buckets,
                           ring_bytes=ring, seconds=time.perf_counter() - t0, agree_seconds=t_agreed - t0,
                           transfer_seconds=seconds, planned=planned, verified=verify,
                           direct_buckets=self._plan.direct_buckets)
        if self._is_sender:
            logger.info("coalesced_bcast: refit sent %d tensors (%.3f GiB, %d buckets) in %.3f s", stats.tensors,
                        stats.bytes / 2**30, stats.buckets, stats.seconds)
        return stats

    def _agree(self, error: Optional[str], timeout: Optional[timedelta], verify: bool) -> None:
        """Trainer ranks, then the refit group, then the sender's verdict back to the trainer ranks."""
        tg = self.trainer_group if self._trainer_world > 1 else None
        msg = error
        if tg is not None:
            v = verdict(Record(REFUSED if error else OK, self._trainer_digest if error is None else 0, 0, error or ""),
                        tg, timeout=timeout)
            msg = _refusal(v, self._trainer_label)
            if msg is None and not v.agreed:
                msg = "the trainer ranks hold different tensors (names, shapes, dtypes or sharding differ)"
        if self._is_sender:
            msg = self._agree_refit(msg, timeout, verify)
        msg = self._tell_trainers(msg, timeout, "the refit's verdict broadcast")
        if msg:
            raise AgreementError(f"coalesced_bcast refit: nothing was sent. {msg}")

    def _tell_trainers(self, msg: Optional[str], timeout: Optional[timedelta], what: str) -> Optional[str]:
        """The sender's verdict to every trainer rank, so that all raise the same error (or none does)."""
        if self._trainer_world == 1:
            return msg
        mine = Record(REFUSED if msg else OK, message=msg or "") if self._is_sender else None
        rec = broadcast_record(mine, self.trainer_group, self.sender_rank, timeout=timeout, what=what)
        return rec.message if rec.status != OK else None

    def _agree_refit(self, msg: Optional[str], timeout: Optional[timedelta], verify: bool) -> Optional[str]:
        """The sender's round with the receivers: its record's count carries its flags (verify)."""
        pg = self.refit_group
        flags = _FLAG_VERIFY if verify else 0
        v = verdict(Record(REFUSED if msg else OK, self.digest, flags, msg or ""), pg, timeout=timeout)
        if msg:
            return msg
        msg = _refusal(v, self._refit_label)
        if msg:
            return msg
        if any(rec.digest != self.digest for rec in v.records):  # a receiver without this plan: it gets the metadata
            broadcast_object({"names": self.names, "units": self.units, "bucket_bytes": self.bucket_bytes,
                              "digest": self.digest}, pg, self.src, timeout=timeout,
                             what="the refit's metadata broadcast")
            return _refusal(verdict(Record(OK, self.digest, flags), pg, timeout=timeout), self._refit_label)
        return None

    def _verify(self, hasher: Optional[_Hasher], timeout: Optional[timedelta]) -> None:
        msg = None
        if self._is_sender:
            pg = self.refit_group
            hashes = hasher.hashes().to(control_device(pg))
            broadcast(hashes, self.src, pg, timeout, "the refit's verify broadcast")
            msg = _refusal(verdict(Record(OK), pg, timeout=timeout), self._refit_label)
        msg = self._tell_trainers(msg, timeout, "the refit's verify verdict")
        if msg:
            raise VerifyError(f"coalesced_bcast refit: {msg}")


class RefitReceiver:
    """The engine side of a refit: make one per process and call :meth:`receive` each step.

    refit_group, src: the refit group and the sender's rank in it.
    tensors: where the weights go, by name (whole tensors of the full shapes, any dtype the engine's
      cast can reach); or on_weights: a callable taking a :class:`RefitBatch` per bucket, on the
      receiving side's copy stream, for an engine's own ``load_weights`` (fuse, shard, cast).
    name_map: the sender's name -> this side's name (a callable or a mapping); None (or a name that maps
      to None) keeps the sender's name. With `tensors`, every sent name must find a tensor unless it
      maps to None (then it is not written).
    direct: with `tensors`, a bucket whose bytes lie back to back in one of them is received straight into
      it, with no copy out of the ring (True, the default); False receives every bucket into the ring,
      never into the tensors' own memory.
    """

    def __init__(self, refit_group: dist.ProcessGroup, *, src: int = 0,
                 tensors: Optional[Mapping[str, torch.Tensor]] = None,
                 on_weights: Optional[Callable[[RefitBatch], None]] = None,
                 name_map: Union[None, Mapping[str, Optional[str]], Callable[[str], Optional[str]]] = None,
                 ring_depth: int = DEFAULT_REFIT_RING_DEPTH, device: Optional[torch.device] = None,
                 direct: bool = True):
        if (tensors is None) == (on_weights is None):
            raise ValueError("RefitReceiver takes tensors (written in place) or on_weights (a callback), one of them")
        self.refit_group, self.src = refit_group, src
        self._tensors, self._on_weights, self._name_map = tensors, on_weights, name_map
        self.ring_depth, self.direct = ring_depth, bool(direct)
        if device is None:
            first = next(iter(tensors.values()), None) if tensors else None
            device = first.device if first is not None else (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available() and "cuda" in {d.type for d in getattr(refit_group, "_device_types", [])}
                else torch.device("cpu"))
        self.device = torch.device(device)
        self.digest = 0
        self._plan = None
        self._meta: Optional[dict] = None

    def _map(self, name: str) -> Optional[str]:
        m = self._name_map
        if m is None:
            return name
        return m(name) if callable(m) else m.get(name, name)

    def _label(self, r: int) -> str:
        return f"refit rank {r} (the sender)" if r == self.src else f"refit rank {r}"

    def _make_plan(self, meta: dict) -> Optional[str]:
        """This side's load plan for the sender's stream, or why it cannot take it."""
        names, units, bucket_bytes = meta["names"], meta["units"], meta["bucket_bytes"]
        rank = self.refit_group.rank()
        dests, dest_rows, dest_keys = [], [], []
        taken: dict[str, str] = {}
        try:
            if self._tensors is not None:
                for i, name in enumerate(names):
                    key = self._map(name)
                    if key is None:
                        continue
                    if key in taken:
                        return (f"'{taken[key]}' and '{name}' both map to '{key}' on refit rank {rank}: a tensor "
                                f"takes one")
                    taken[key] = name
                    t = self._tensors.get(key)
                    shape = tuple(units[i, 2:2 + int(units[i, 1])].tolist())
                    if t is None:
                        return f"'{name}' (as '{key}') has no tensor on refit rank {rank}"
                    if tuple(t.shape) != shape:
                        return (f"'{name}' (as '{key}') is {list(shape)} on the sender but {list(t.shape)} on refit "
                                f"rank {rank}")
                    # The object itself, not a detached view: a kept plan's check must see its storage move.
                    dests.append(t)
                    dest_keys.append(key)
                    dest_rows.append([i] + [0] * 8)
            self._plan = _C.load_plan(units, [], dests, _int64_table(dest_rows, 9), bucket_bytes, self.ring_depth,
                                      rank, 1, self.device, whole_units=True, kept=True, direct=self.direct)
        except (TypeError, ValueError, RuntimeError) as e:
            return str(e)
        self._meta = meta
        self._dest_keys = dest_keys
        self._rows = _C.bucket_units(units, bucket_bytes, True)
        # Per bucket: views, and the callback's batches under this side's names (a name mapped to None is left out).
        mapped = [self._map(n) for n in names]
        self._views = _C.SlotViews(units, self._rows, mapped)
        # Zero-element tensors have no bytes in any bucket: the callback gets them as one last batch of
        # empty tensors, so that an engine's load_weights sees every name it is sent.
        dims = units[:, 2:]
        zero = ((dims == 0) & (torch.arange(dims.shape[1]) < units[:, 1:2])).any(1)  # one pass, not one per tensor
        self._empty = [(mapped[i], tuple(units[i, 2:2 + int(units[i, 1])].tolist()), _dtype_of_code(int(units[i, 0])))
                       for i in zero.nonzero().flatten().tolist() if mapped[i] is not None]
        self.digest = meta["digest"]
        return None

    def _hook(self, hasher: Optional[_Hasher]):
        if self._on_weights is None and hasher is None:
            return None

        def hook(k: int, slot: torch.Tensor) -> None:
            if hasher is not None:
                hasher(k, slot)
            if self._on_weights is not None:
                self._on_weights(RefitBatch(*self._views.batch(k, slot)))
        return hook

    @gc_paused
    def receive(self, *, timeout: Optional[Union[float, timedelta]] = None) -> RefitStats:
        """Take one refit from the sender: every receiver calls it while the trainer calls send()."""
        t0 = time.perf_counter()
        timeout = as_timedelta(timeout)
        pg = self.refit_group
        ctrl = control_device(pg)
        planned = False
        error = self._plan.check_unchanged() if self._plan is not None else ""
        if error:  # the core numbers destinations: name them
            error = re.sub(r"destination (\d+)", lambda m: f"tensor '{self._dest_keys[int(m.group(1))]}'", error)
            error = f"{error}; make a new RefitReceiver"
        v = verdict(Record(REFUSED if error else OK, self.digest, 0, error or ""), pg, timeout=timeout)
        flags, sender_digest = v.records[self.src].count, v.records[self.src].digest
        msg = _refusal(v, self._label)
        if msg is None and any(rec.digest != sender_digest for rec in v.records):
            meta = broadcast_object(None, pg, self.src, timeout=timeout, what="the refit's metadata broadcast")
            rebuild = self.digest != sender_digest
            problem = self._make_plan(meta) if rebuild else None
            planned = rebuild and problem is None
            v = verdict(Record(REFUSED if problem else OK, self.digest, 0, problem or ""), pg, timeout=timeout)
            msg = _refusal(v, self._label)
        if msg:
            raise AgreementError(f"coalesced_bcast refit: nothing was sent. {msg}")
        t_agreed = time.perf_counter()
        verify = bool(flags & _FLAG_VERIFY)
        hasher = _Hasher(self._views) if verify else None
        try:
            seconds, ring, *_ = self._plan.broadcast(pg, self.src, timeout.total_seconds() if timeout else 0.0,
                                                    None, 0.0, self._hook(hasher))
        except RuntimeError as e:
            raise CollectiveError(f"coalesced_bcast: the refit transfer failed on refit rank {pg.rank()}: {e}") from e
        if self._on_weights is not None and self._empty:
            self._on_weights(RefitBatch([(key, torch.empty(shape, dtype=dtype, device=self.device))
                                         for key, shape, dtype in self._empty], []))
        if verify:
            self._verify(hasher, ctrl, timeout)
        return RefitStats(tensors=len(self._meta["names"]), bytes=self._plan.total_bytes,
                          buckets=self._plan.num_buckets, ring_bytes=ring, seconds=time.perf_counter() - t0,
                          agree_seconds=t_agreed - t0, transfer_seconds=seconds, planned=planned, verified=verify,
                          direct_buckets=self._plan.direct_buckets)

    def _dest_hashes(self, hashes: torch.Tensor) -> torch.Tensor:
        """In place, a row's hash is of the destination's own elements where it holds the wire's dtype (what the
        engine reads), else of the bytes the slot held (a cast's result is not the sender's bytes)."""
        rows = self._rows
        units = self._meta["units"]
        names = self._meta["names"]
        views, where = [], []
        for j, (_, u, first, count, _) in enumerate(rows.tolist()):
            key = self._map(names[u])
            t = self._tensors.get(key) if key is not None else None
            if t is not None and _dtype_code(t.dtype) == int(units[u, 0]):
                views.append(t.detach().reshape(-1)[first:first + count])
                where.append(j)
        if views:
            hashes = hashes.clone()
            hashes[torch.tensor(where, device=hashes.device)] = _C.hash_tensors(views)[:-1].to(hashes.device)
        return hashes

    def _verify(self, hasher: _Hasher, ctrl: torch.device, timeout: Optional[timedelta]) -> None:
        pg = self.refit_group
        mine = hasher.hashes()
        if self._tensors is not None:
            mine = self._dest_hashes(mine)
        theirs = torch.empty_like(mine, device=ctrl)
        broadcast(theirs, self.src, pg, timeout, "the refit's verify broadcast")
        diff = (mine.to(ctrl) != theirs).nonzero()
        problem = ""
        if diff.numel():
            _, u, first, count, _ = self._rows[int(diff[0, 0])].tolist()
            problem = (f"'{self._meta['names'][u]}' (elements {first}..{first + count}) differs from the sender's "
                       f"on refit rank {pg.rank()}")
        msg = _refusal(verdict(Record(REFUSED if problem else OK, message=problem), pg, timeout=timeout), self._label)
        if msg:
            raise VerifyError(f"coalesced_bcast refit: {msg}")

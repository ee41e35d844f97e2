"""FSDP1 helpers: a ``param_init_fn`` that allocates without computing, and tied-weight restoration.

Ranks other than the source build the model on the meta device; FSDP1 calls ``param_init_fn`` on
each of their modules before its per-unit sync, and the sync then writes the source's bytes.

    model = FSDP(model, sync_module_states=True, device_id=dev,
                 param_init_fn=coalesced_bcast.fsdp.param_init_fn(dev))

With ``install()``, FSDP1 hands this ``param_init_fn`` each unit whole: the unit's parameters are laid
out in one buffer in FSDP1's flatten order, and that buffer becomes the unit's FlatParameter without
the copy FSDP1 otherwise makes (the init's peak falls by the largest unit's size).

Tied weights (``lm_head.weight is embed.weight`` on the source):
- with this ``param_init_fn``, a tie present in the meta model stays one tensor, whether both modules
  are in one FSDP unit or in different units: the other ranks then have the source's structure;
- with another ``param_init_fn`` that splits ties (plain ``to_empty``, pytorch issue 143181), or a
  meta model built without the tie, ``install()`` repairs ties *within one FSDP unit*: when the
  unit's structure check fails (on every rank, before any byte moves), the source sends its tie
  groups by parameter name, the other ranks re-point the names and the sync is retried once;
- anything still different (a tie across units that was split, another shape, a tie the source
  lacks) raises the same AgreementError on every rank, naming the tensor.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

logger = logging.getLogger(__name__)

TieGroups = dict[str, list[list[str]]]


class MetaMaterializer:
    """The callable FSDP1 wants as ``param_init_fn``: allocates a module's own meta tensors on ``device``.

    Unlike ``module.to_empty(device, recurse=False)``, a meta parameter (or buffer) shared by several
    modules, such as ``lm_head.weight is embed.weight``, becomes one tensor on the device, not one per
    module: the memo maps each meta tensor to what it became, across every call of this object, so a
    tie survives even when its modules are materialized by different FSDP units. Tensors that are
    already real are left alone (``to_empty`` would replace their storage with garbage, possibly
    after FSDP synced and flattened them). Values are uninitialized: they come from the source.
    """

    def __init__(self, device: Union[torch.device, str, int]):
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        # id(meta tensor) -> its replacement, only while the meta tensor lives, i.e. while some module
        # still holds it: a strong reference past that would keep every original parameter (the whole
        # model) alive after FSDP flattened and sharded it.
        self._memo: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"coalesced_bcast.fsdp.param_init_fn({self.device})"

    def __call__(self, module: nn.Module) -> nn.Module:
        """Materialize ``module``'s own meta tensors; returns ``module``, as frameworks that wrap a
        ``param_init_fn`` expect (accelerate's ``ensure_weights_retied`` reads ties from the result)."""
        params = {k: p for k, p in module._parameters.items() if p is not None}
        buffers = {k: b for k, b in module._buffers.items() if b is not None}
        if not any(t.is_meta for t in (*params.values(), *buffers.values())):
            return module
        simple = all(t.is_meta and id(t) not in self._memo for t in (*params.values(), *buffers.values()))
        if simple:
            # torch's own path: keeps its handling of Parameter subclasses and the __future__ flags.
            module.to_empty(device=self.device, recurse=False)
        else:
            with torch.no_grad():
                for k, p in params.items():
                    if p.is_meta:
                        module._parameters[k] = self._new(p, lambda: nn.Parameter(
                            torch.empty_like(p, device=self.device), p.requires_grad))
                for k, b in buffers.items():
                    if b.is_meta:
                        module._buffers[k] = self._new(b, lambda: torch.empty_like(b, device=self.device))
        for k, p in params.items():
            self._remember(p, module._parameters[k])
        for k, b in buffers.items():
            self._remember(b, module._buffers[k])
        return module

    def _remember(self, meta: torch.Tensor, new: torch.Tensor) -> None:
        if new is meta or not meta.is_meta or id(meta) in self._memo:  # swapped in place: ties hold already
            return
        self._memo[id(meta)] = new
        weakref.finalize(meta, self._memo.pop, id(meta), None)

    def _new(self, meta: torch.Tensor, make) -> torch.Tensor:
        hit = self._memo.get(id(meta))
        # A hit whose memory FSDP already freed: a tie across units whose first unit was flattened in
        # place and sharded. This unit flattens its own copy anyway (FSDP1 duplicates such ties) and
        # the sync writes its values: give it fresh memory.
        return hit if hit is not None and not _freed(hit) else make()

    def materialize_unit(self, modules: list[nn.Module]) -> None:
        """Materialize one FSDP unit (``modules``: those FSDP would hand to ``param_init_fn``, the
        unit's root first): its meta parameters go into one buffer, in the order FSDP1 flattens them,
        so that FSDP's flatten can use that buffer as the unit's FlatParameter instead of copying
        (see :func:`flatten_in_place`); everything else as by ``__call__``.

        Why: FSDP1 holds the unit's originals, their flat copy and the shard's clone at once; for the
        largest unit (embedding and head) that is the whole init's peak. Without the copy the peak
        is one unit smaller. A unit whose parameters are not all meta, not all of one dtype, or not
        all plain ``nn.Parameter`` s is materialized module by module instead.
        """
        order, slots = _unit_params(modules)
        if order and self._arena_ok(order):
            arena = torch.empty(sum(p.numel() for p in order), dtype=order[0].dtype, device=self.device)
            new = _point_into(arena, order, slots, keep_attributes=False)
            for p in order:
                self._remember(p, new[id(p)])
        for module in modules:  # buffers, and the parameters of a unit without an arena
            self(module)

    def _arena_ok(self, order: list[torch.Tensor]) -> bool:
        dtype = order[0].dtype
        return all(type(p) is nn.Parameter and p.is_meta and p.dtype == dtype and id(p) not in self._memo
                   for p in order)


def _freed(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


Slots = list[tuple[nn.Module, str, nn.Parameter]]


def _flatten_order(root: Optional[nn.Module], take) -> tuple[list[nn.Parameter], Slots]:
    """The parameters ``take(module, param)`` selects under ``root``, in FSDP1's flatten order
    (``named_modules(remove_duplicate=False)`` from the unit's root, each module's own parameters,
    first occurrence), and every module slot holding one of them."""
    order: dict[int, nn.Parameter] = {}
    slots = []
    for _, module in root.named_modules(remove_duplicate=False) if root is not None else ():
        for key, p in module._parameters.items():
            if p is not None and take(module, p):
                order.setdefault(id(p), p)
                slots.append((module, key, p))
    return list(order.values()), slots


def _unit_params(modules: list[nn.Module]) -> tuple[list[nn.Parameter], Slots]:
    """The unit's meta parameters (``modules``: the unit's root first), in FSDP1's flatten order."""
    inside = set(modules)
    return _flatten_order(modules[0] if modules else None, lambda m, p: m in inside and p.is_meta)


def _fill_one_buffer(order: list[torch.Tensor]) -> bool:
    """The tensors are one storage, whole: each contiguous and starting where the one before ends."""
    if any(p.is_meta for p in order):
        return False
    storage, offset = order[0].untyped_storage(), 0
    for p in order:
        if (p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset
                or not p.is_contiguous()):
            return False
        offset += p.numel()
    return offset * order[0].element_size() == storage.nbytes()


def lay_out_unit(root: nn.Module, params: list[nn.Parameter]) -> bool:
    """Copy a unit's parameters (FSDP1's managed list ``params``) into one buffer, back to back in
    FSDP1's flatten order, and point the unit's modules and ``params`` (edited in place) at them.

    Called by ``install()`` before a unit's sync on every rank whose unit is not laid out so already
    (the source, which built the model itself): with both sides in one buffer, the unit is one
    broadcast rather than one per parameter, and FSDP1's flatten uses the buffer instead of copying
    into a new one (see :func:`flatten_in_place`). Values are copied, not moved: if the sync then
    fails, the model is as it was. The old tensors are freed unless something else holds them (a
    tie to a module outside the unit keeps its old tensor, as FSDP1 keeps it for such ties).
    Returns whether it laid the unit out; a unit of several dtypes, or of parameter subclasses, or
    already laid out, is left alone.
    """
    if len(params) < 2 or _fill_one_buffer(params):  # the usual case off rank 0: our param_init_fn's buffer
        return False
    keep = {id(p) for p in params}
    order, slots = _flatten_order(root, lambda m, p: id(p) in keep)
    if (len(order) < 2 or len(order) != len(keep) or _fill_one_buffer(order)
            or any(type(p) is not nn.Parameter or p.is_meta for p in order)
            or len({(p.dtype, p.device) for p in order}) != 1):
        return False
    try:
        with torch.no_grad():
            arena = torch.cat([p.reshape(-1) for p in order])  # one allocation and one kernel
    except torch.OutOfMemoryError:
        # Not here: this rank would then skip the sync the others are in. FSDP1's flatten needs as much
        # and says so, after the sync.
        logger.warning("coalesced_bcast: no memory to lay FSDP unit %s out in one buffer; FSDP1 will copy it",
                       type(root).__name__)
        return False
    new = _point_into(arena, order, slots, keep_attributes=True)
    params[:] = [new[id(p)] for p in params]
    return True


def _point_into(arena: torch.Tensor, order: list[nn.Parameter], slots: Slots,
                keep_attributes: bool) -> dict[int, nn.Parameter]:
    """New parameters viewing ``arena`` back to back in ``order``, every slot pointed at its new one,
    and the arena registered for :func:`flatten_in_place`. Returns id(old) -> new."""
    new: dict[int, nn.Parameter] = {}
    # One split for all the views: FSDP1 calls this once per unit, and each torch call costs the host.
    for p, piece in zip(order, arena.split([p.numel() for p in order])):
        q = nn.Parameter(piece.view(p.shape), p.requires_grad)
        if keep_attributes and p.__dict__:  # attributes a user or a library set on a real parameter
            q.__dict__.update(p.__dict__)
        new[id(p)] = q
    for module, key, p in slots:
        module._parameters[key] = new[id(p)]
    _register_arena(arena, [new[id(p)] for p in order])
    return new


@dataclass
class _Arena:
    """A unit's parameters laid out back to back in one buffer, waiting for FSDP1 to flatten them."""

    params: list  # weakref.ref to each parameter, in flatten order
    numel: int


_arenas: dict[int, _Arena] = {}  # storage address -> arena; cleared by the next unit and by uninstall()
_counts = {"arenas": 0, "flattened_in_place": 0, "flattened_by_copy": 0, "superseded": 0}


def _register_arena(arena: torch.Tensor, params: list[nn.Parameter]) -> None:
    # One waits for FSDP's flatten at a time; one still here was a unit FSDP did not flatten (its memory
    # lives on in its params), or this unit's before a re-tie laid it out again.
    _counts["superseded"] += len(_arenas)
    _arenas.clear()
    _arenas[arena.untyped_storage().data_ptr()] = _Arena([weakref.ref(p) for p in params], arena.numel())
    _counts["arenas"] += 1


def flatten_in_place(tensors: list[torch.Tensor], aligned_numel: int) -> Optional[torch.Tensor]:
    """FSDP1's flat tensor for ``tensors`` without a copy, if they are exactly an arena's parameters
    in order (then the arena is the flat tensor); else None, and FSDP copies as usual.

    Exactly: the same objects, contiguous, back to back from the buffer's start, no padding to add.
    FSDP then shards it and frees the buffer (``storage.resize_(0)``), as it frees its own copy.
    """
    if not _arenas or not tensors or tensors[0].is_meta:
        return None
    arena = _arenas.pop(tensors[0].untyped_storage().data_ptr(), None)
    if arena is None:
        return None
    offset, ok = 0, aligned_numel == 0 and len(tensors) == len(arena.params)
    for t, ref in zip(tensors, arena.params) if ok else ():
        if t is not ref() or not t.is_contiguous() or t.storage_offset() != offset:
            ok = False
            break
        offset += t.numel()
    if not ok or offset != arena.numel:
        _counts["flattened_by_copy"] += 1
        logger.debug("coalesced_bcast: FSDP flattens a unit other than its arena's parameters; copying")
        return None
    _counts["flattened_in_place"] += 1
    flat = torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device)
    return flat.set_(tensors[0].untyped_storage(), 0, (offset,), (1,))


def arena_counts() -> dict[str, int]:
    """Units given one buffer (by :meth:`MetaMaterializer.materialize_unit` or :func:`lay_out_unit`),
    and how FSDP1 flattened them: in place (no copy) or by its usual copy; superseded: replaced by
    another buffer before FSDP1 flattened it."""
    return dict(_counts)


def param_init_fn(device: Union[torch.device, str, int]) -> MetaMaterializer:
    """``param_init_fn`` for FSDP1 on ranks that built the model on meta: allocation only, ties kept.

    Pass it on every rank (FSDP1 only calls it on modules that are on meta) together with
    ``sync_module_states=True``; the values then come from rank 0 of the FSDP group.
    """
    return MetaMaterializer(device)


def _named(module: nn.Module, kind: str) -> list[tuple[str, torch.Tensor]]:
    it = module.named_parameters if kind == "params" else module.named_buffers
    return [(n, t) for n, t in it(remove_duplicate=False) if t is not None]


def tie_groups(module: nn.Module, only: Optional[Iterable[torch.Tensor]] = None) -> TieGroups:
    """Names that share one parameter (or buffer) object, in registration order; groups of 2 or more.

    ``only``: keep parameters among these objects (FSDP's managed parameters of one unit).
    """
    keep = {id(t) for t in only} if only is not None else None
    out: TieGroups = {}
    for kind in ("params", "buffers"):
        by_obj: dict[int, list[str]] = {}
        for name, t in _named(module, kind):
            if kind == "params" and keep is not None and id(t) not in keep:
                continue
            by_obj.setdefault(id(t), []).append(name)
        out[kind] = [names for names in by_obj.values() if len(names) > 1]
    return out


def _set(module: nn.Module, name: str, kind: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    (owner._parameters if kind == "params" else owner._buffers)[leaf] = value


def apply_tie_groups(module: nn.Module, groups: TieGroups) -> dict[int, torch.Tensor]:
    """Point every name of each group at the group's first tensor. Returns id(replaced) -> kept tensor.

    A group naming a tensor this module lacks, or members of different shape, dtype or device, is
    skipped: that is a structural difference, left for the sync's agreement to report on every rank.
    """
    replaced: dict[int, torch.Tensor] = {}
    for kind in ("params", "buffers"):
        named = dict(_named(module, kind))
        for names in groups.get(kind, []):
            if not all(n in named for n in names):
                continue
            keep = named[names[0]]
            members = [named[n] for n in names[1:]]
            if any((t.shape, t.dtype, t.device) != (keep.shape, keep.dtype, keep.device) for t in members):
                continue
            for n, t in zip(names[1:], members):
                if t is not keep:
                    _set(module, n, kind, keep)
                    replaced[id(t)] = keep
    return replaced


def restore_ties(
    module: nn.Module,
    src: int = 0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    only: Optional[list[torch.Tensor]] = None,
) -> int:
    """Give every rank the source's tied weights (collective: one small ``broadcast_object_list``).

    On the source nothing changes; elsewhere each name the source ties is pointed at one tensor (the
    group's first name's), as ``to_empty`` on a meta model may have split them (pytorch issue 143181).
    Values are not touched: sync afterwards. Ties the source lacks are not undone; a structure that
    still differs is reported by the sync's agreement on every rank. ``src`` is a global rank.
    If ``only`` is a list of parameters (FSDP's managed list), replaced ones are removed from it in
    place, keeping first occurrences, so that it matches the source's deduplicated list.
    Returns how many names were re-pointed on this rank.
    """
    pg = group if group is not None else dist.group.WORLD
    is_src = dist.get_rank() == src
    box = [tie_groups(module, only) if is_src else None]
    dist.broadcast_object_list(box, src=src, group=pg)
    if is_src:
        return 0
    replaced = apply_tie_groups(module, box[0])
    if only is not None and replaced:
        seen: set[int] = set()
        kept = []
        for p in only:
            p = replaced.get(id(p), p)
            if id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        only[:] = kept
    if replaced:
        logger.info("coalesced_bcast: rank %d re-tied %d tensors to match source rank %d", dist.get_rank(),
                    len(replaced), src)
    return len(replaced)

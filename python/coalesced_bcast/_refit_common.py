"""Parts of a refit that both sides share: its group, its stats, the per-piece hasher of verify, the
callback's batches, and the plan digest."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import _C


@dataclass(frozen=True)
class RefitStats:
    tensors: int  # tensors in the stream
    bytes: int  # their bytes, in the wire's dtypes
    buckets: int
    ring_bytes: int  # device bytes of this process's ring and tables
    seconds: float  # wall time of the call on this process
    agree_seconds: float
    transfer_seconds: float  # host time of the transfer (CUDA work may still be queued)
    planned: bool  # this call made (or remade) the plan
    verified: bool
    # buckets this process sent from or received into the tensors' own memory, with no copy and no ring
    # slot: their bytes lie back to back in one storage here (an unsharded sender's or an engine's
    # buffer), in the wire's dtype
    direct_buckets: int = 0


def init_refit_group(host: Optional[str], port: int, rank: int, world_size: int, *,
                     device: Union[str, torch.device] = "cuda", timeout: timedelta = timedelta(minutes=10),
                     name: str = "coalesced_bcast_refit", is_master: Optional[bool] = None,
                     store: Optional[dist.Store] = None) -> dist.ProcessGroup:
    """A process group of `world_size` processes met at a TCPStore on host:port, apart from any default group.

    Rank 0 (by convention the trainer's sending rank) hosts the store unless `is_master` says otherwise;
    or pass a `store` that every process reaches (host and port are then not used).
    The group has gloo for CPU tensors and, for `device` cuda, NCCL for CUDA tensors; every API of this
    package takes it. Processes that already share one world can use ``dist.new_group(ranks)`` instead.
    """
    device = torch.device(device)
    if store is None:
        store = dist.TCPStore(host, port, world_size, rank == 0 if is_master is None else is_master, timeout=timeout)
    prefix = dist.PrefixStore(f"{name}/", store)
    cuda = device.type == "cuda"
    if hasattr(dist.ProcessGroup, "_set_default_backend"):
        pg = dist.ProcessGroup(prefix, rank, world_size)
    else:  # torch 2.4: the default backend is a constructor option
        options = dist.ProcessGroup.Options(backend="nccl" if cuda else "gloo")
        options._timeout = timeout
        pg = dist.ProcessGroup(prefix, rank, world_size, options)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", prefix), rank, world_size, timeout)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    if cuda:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", prefix), rank, world_size, opts)
        pg._register_backend(device, dist.ProcessGroup.BackendType.NCCL, nccl)
    if hasattr(pg, "_set_default_backend"):
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL if cuda else dist.ProcessGroup.BackendType.GLOO)
    pg._set_group_name(name)
    pg._set_group_desc(name)
    return pg


def _digest(*parts: Any) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
    return int.from_bytes(h.digest(), "little", signed=True) or 1  # 0 means "no plan"


class _Hasher:
    """Per piece (bucket_units' rows) a 64-bit hash of the bytes a bucket's slot holds: what verify compares."""

    def __init__(self, views: "_C.SlotViews"):
        self.slot_views = views
        self.parts: list[torch.Tensor] = []

    def __call__(self, k: int, slot: torch.Tensor) -> None:
        views = self.slot_views.views(k, slot)
        if views:
            self.parts.append(_C.hash_tensors(views)[:-1])

    def hashes(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.int64)


class RefitBatch(list):
    """One bucket's weights, as ``(name, tensor)`` pairs of views into the ring slot: valid only during the
    callback (copy what you keep). A tensor larger than a bucket comes in pieces instead, listed in
    ``pieces`` as ``(name, flat_view, first_element, full_shape)``, in order, one or more per bucket.
    Zero-element tensors, which no bucket holds, come in one last batch as empty tensors of their shape."""

    def __init__(self, pairs: list, pieces: list):
        super().__init__(pairs)
        self.pieces = pieces

"""install() hands a sync to torch's own function where coalesced_bcast cannot drive the group, on every
rank alike, and records why: a group torch.distributed does not know (made by hand, as torch's own c10d
tests make them) and a ProcessGroup implemented in Python. Both still sync bitwise, as torch's path does;
a registered group is still served."""
import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _ddp_sync(pg, rank, what) -> list:
    """DDP's init sync (torch.nn.parallel.distributed._sync_module_states) of a model built from this
    rank's seed, over `pg`, with install() active: every rank must end with rank 0's values. Returns
    the calls install() recorded."""
    from torch.nn.parallel import distributed as ddp_mod
    model = _net(rank)
    coalesced_bcast.patched_calls(clear=True)
    with coalesced_bcast.installed():
        ddp_mod._sync_module_states(model, pg, 250 * 2**20, 0, set(), True)
    _same_as_rank0(model, rank, what)
    return coalesced_bcast.patched_calls()


def _same_as_rank0(model, rank, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    assert all(torch.equal(o, out[0]) for o in out), f"{what}: rank {rank} differs from rank 0"


def _unregistered_group(rank, world_size):
    """A ProcessGroup over gloo made by hand, as torch's own c10d tests make them: torch.distributed
    does not know it (no global ranks, no store of its own)."""
    store = dist.PrefixStore("unregistered", dist.distributed_c10d._get_default_store())
    try:
        pg = dist.ProcessGroup(store, rank, world_size)
    except TypeError:  # torch < 2.5: the constructor takes the group's options too
        pg = dist.ProcessGroup(store, rank, world_size, dist.ProcessGroup.Options(backend="gloo"))
    backend = dist.ProcessGroupGloo(store, rank, world_size)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if hasattr(pg, "_set_default_backend"):  # torch < 2.5 takes the default from the options' backend
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _unregistered_body(rank, world_size):
    calls = _ddp_sync(_unregistered_group(rank, world_size), rank, "DDP's sync over an unregistered group")
    assert [c.site for c in calls] == ["ddp"] and calls[0].stats is None, calls
    assert "not registered with torch.distributed" in calls[0].fallback, calls


def test_ddp_sync_over_an_unregistered_group_falls_back():
    run_ranks(2, _unregistered_body)


class _PythonGroup(dist.ProcessGroup):
    """A ProcessGroup implemented in Python (as frameworks and torch's own tests build): broadcasts
    through a registered gloo group."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.broadcasts = 0

    def broadcast(self, tensors, opts):
        self.broadcasts += 1
        return self.inner.broadcast(tensors, opts)

    def getBackendName(self):
        return "python-wrapper"


def _python_group_body(rank, world_size):
    pg = _PythonGroup(dist.new_group(backend="gloo"))
    calls = _ddp_sync(pg, rank, "DDP's sync over a Python ProcessGroup")
    assert pg.broadcasts > 0  # torch's path went through the Python group
    assert [c.site for c in calls] == ["ddp"] and calls[0].stats is None, calls
    assert "_PythonGroup" in calls[0].fallback, calls
    # A registered group is still served by coalesced_bcast.
    calls = _ddp_sync(dist.group.WORLD, rank, "DDP's sync over the world")
    assert [c.site for c in calls] == ["ddp"] and calls[0].fallback is None and calls[0].stats is not None, calls


def test_ddp_sync_over_a_python_group_falls_back():
    run_ranks(2, _python_group_body)

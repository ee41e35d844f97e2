"""install() hands a sync to torch's own function where coalesced_bcast cannot drive the group, on every
rank alike, and records why: a group torch.distributed does not know (made by hand, as torch's own c10d
tests make them), a ProcessGroup implemented in Python, and torch's multi-threaded test group. All still
sync bitwise, as torch's path does; a registered group is still served."""
import contextlib

import pytest
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


def test_ddp_init_over_torchs_threaded_test_group_falls_back(monkeypatch):
    """Torch's multi-threaded test group (ranks are threads of one process, its ProcessLocalGroup a
    ProcessGroup implemented in Python): DDP's init with install() syncs as torch's own path does, and
    the call is recorded as handed back, with the reason, on every rank."""
    import threading
    try:
        from torch.testing._internal.distributed import multi_threaded_pg as mt
    except ImportError as e:  # pragma: no cover
        import pytest
        pytest.skip(f"this torch has no threaded test group: {e}")
    from torch.nn.parallel import DistributedDataParallel as DDP
    world = 2
    store = dist.HashStore()
    results, errors = {}, []

    def rank_main(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            model = DDP(_net(rank))
            out = [None] * world
            dist.all_gather_object(out, [t.detach().clone() for t in model.module.state_dict().values()])
            results[rank] = out
            dist.destroy_process_group()
        except BaseException as e:  # reported by the main thread; the other ranks are woken, not left waiting
            errors.append((rank, e))
            mt.ProcessLocalGroup.exception_handle(e)

    if not hasattr(mt.ThreadLocalWorld, "comms"):
        # torch 2.11's destroy_process_group() reads `_world.comms`, which its threaded world lacks (an
        # AttributeError on every rank, with or without install(); later releases give it one). The threaded
        # backend makes no torchcomms, so an empty list each time is what that world would hold.
        monkeypatch.setattr(mt.ThreadLocalWorld, "comms", property(lambda self: []), raising=False)
    isolate = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)  # as torch's test case does
    if isolate is not None:
        isolate(True)
    mt._install_threaded_pg()
    coalesced_bcast.patched_calls(clear=True)
    try:
        with coalesced_bcast.installed():
            threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
    finally:
        mt._uninstall_threaded_pg()
        if isolate is not None:
            isolate(False)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "a rank thread hung"
    for rank in range(world):  # every rank ends with rank 0's values, bitwise
        for mine, src in zip(results[rank][rank], results[rank][0]):
            assert torch.equal(mine.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)), rank
    calls = coalesced_bcast.patched_calls()
    assert [c.site for c in calls] == ["ddp"] * world and all(c.stats is None for c in calls), calls
    assert all("ProcessLocalGroup" in c.fallback for c in calls), calls


def _conv_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1))


def _ddp_check_fails_body(rank, world_size, use_install):
    """torch's test_c10d_nccl::test_param_layout_mismatch_error over gloo: rank 1's parameters are
    channels_last, so DDP's own check raises there, before the sync, while rank 0 passes it and syncs.
    Outcome with torch's path: rank 0's DDP is made (its broadcast waits for a peer), rank 1 raises
    torch's error. install() must give the same, not leave rank 0 in the agreement until the timeout."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _conv_net(rank)
    if rank == 1:
        model = model.to(memory_format=torch.channels_last)
    coalesced_bcast.patched_calls(clear=True)
    with coalesced_bcast.installed() if use_install else contextlib.nullcontext():
        if rank == 0:
            DDP(model)
        else:
            with pytest.raises(RuntimeError, match="appears not to match strides of the same param in process 0"):
                DDP(model)
            # What rank 0's handed-back sync waits for: torch's own buckets of the same bytes.
            states = [*(p.detach() for p in model.parameters()), *(b.detach() for b in model.buffers())]
            dist._broadcast_coalesced(dist.group.WORLD, states, 250 * 2**20, 0)
    calls = coalesced_bcast.patched_calls()
    if use_install:
        assert [c.site for c in calls] == ["ddp"] and calls[0].stats is None, calls
        assert "raised in DDP's check that its parameters match rank 0's" in calls[0].fallback, calls
    else:
        assert calls == []


@pytest.mark.parametrize("use_install", [False, True], ids=["torch", "installed"])
def test_a_rank_that_fails_ddps_parameter_check_leaves_rank_0_to_torchs_sync(use_install):
    run_ranks(2, _ddp_check_fails_body, use_install, timeout=60)


def _ddp_counts_differ_body(rank, world_size):
    """A rank with an extra layer: DDP's check raises on every rank (the counts are all-gathered); with
    install() every rank raises torch's own error, as without it."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _conv_net(0)
    if rank == 1:
        model.append(nn.Conv2d(4, 4, 1))
    coalesced_bcast.patched_calls(clear=True)
    with coalesced_bcast.installed():
        with pytest.raises(RuntimeError, match="DDP expects same model across all ranks"):
            DDP(model)
    calls = coalesced_bcast.patched_calls()
    assert [c.site for c in calls] == ["ddp"] and "DDP's check" in calls[0].fallback, calls


def test_ranks_that_all_fail_ddps_parameter_check_raise_torchs_error():
    run_ranks(2, _ddp_counts_differ_body, timeout=60)

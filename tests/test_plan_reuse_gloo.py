"""Kept plans (plan_sync / SyncPlan.run) over gloo: repeated runs send new values bitwise, a changed
tensor raises the same AgreementError on every rank before any byte moves, replan recovers."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from coalesced_bcast import agree
from dist_utils import run_ranks
from zoo import make_zoo, same_bits


def _values(rank, src, step, t):
    """What the source holds at `step` (others hold junk): a function of step, so every run sends new bytes."""
    g = torch.Generator().manual_seed(100 * step + (0 if rank == src else 7 + rank))
    return torch.randint(-2**15, 2**15, t.shape, generator=g, dtype=torch.int32).to(t.dtype) if t.dtype != torch.bool \
        else torch.randint(0, 2, t.shape, generator=g).bool()


def _fill(zoo, rank, src, step):
    seen = set()
    for _, t in zoo:
        if id(t) not in seen and t.numel():
            seen.add(id(t))
            t.copy_(_values(rank, src, step, t))


def _reuse_body(rank, world_size, speculate=False, store_max=None):
    if store_max is not None:  # "0": the agreement as a collective (groups beyond the store's limit)
        os.environ[agree._STORE_ENV] = store_max
    src = 1
    zoo = make_zoo(3, torch.device("cpu"), 4096, value_seed=0)
    expect = make_zoo(3, torch.device("cpu"), 4096, value_seed=0)
    plan = coalesced_bcast.plan_sync([t for _, t in zoo], src=src, names=[n for n, _ in zoo], bucket_bytes=4096,
                                     inplace_min_bytes=2048, speculate=speculate)
    for step in range(4):
        _fill(zoo, rank, src, step)
        _fill(expect, src, src, step)
        stats = plan.run(verify=step == 3)
        wrong = [n for (n, t), (_, e) in zip(zoo, expect) if not same_bits(t, e)]
        assert not wrong, f"rank {rank} step {step}: {wrong}"
        assert stats.tensors == len(zoo)
        # the first run agrees on the layout; each later one sends one bucket per slot before agreeing
        assert stats.speculated == (min(stats.buckets, 2) if speculate and step > 0 else 0), (step, stats)
    # a re-allocated tensor (.data assigned) on one rank: every rank raises, naming it, before any byte moves
    names = [n for n, _ in zoo]
    victim = next(i for i, (n, t) in enumerate(zoo) if t.numel() > 4 and t.is_contiguous() and n != "tied.a")
    before = [t.clone() for _, t in zoo]
    if rank == 0:
        zoo[victim][1].data = zoo[victim][1].data.clone()
    _fill(zoo, rank, src, 9) if rank == src else None
    if rank == src:
        before = [t.clone() for _, t in zoo]
    with pytest.raises(coalesced_bcast.AgreementError, match=f"rank 0 refused.*'{names[victim]}'.*re-allocated"):
        plan.run()
    assert all(same_bits(t, b) for (_, t), b in zip(zoo, before)), "a refused run wrote something"
    # replan: the changed rank plans again, every rank agrees, the new storage receives the source's bytes
    plan.run(replan=True)
    _fill(expect, src, src, 9)
    wrong = [n for (n, t), (_, e) in zip(zoo, expect) if not same_bits(t, e)]
    assert not wrong, f"rank {rank} after replan: {wrong}"
    if speculate:
        # the source (step 10), then a receiver (step 12) re-allocates a tensor and replans: what went out
        # before the agreement (the source's slots unpacked) is dropped on every rank and sent again
        # (speculated 0), bitwise; the run after speculates again
        for step in (10, 11, 12, 13):
            if step in (10, 12) and rank == (src if step == 10 else 0):
                zoo[victim][1].data = zoo[victim][1].data.clone()
            _fill(zoo, rank, src, step)
            _fill(expect, src, src, step)
            stats = plan.run(replan=True)
            wrong = [n for (n, t), (_, e) in zip(zoo, expect) if not same_bits(t, e)]
            assert not wrong, f"rank {rank} step {step}: {wrong}"
            assert stats.speculated == (0 if step in (10, 12) else min(stats.buckets, 2)), (step, stats)
        # the source re-allocates a tensor that its first buckets do not read: it packs and sends them, and the
        # rest of its check (past the inputs it checked before packing) still finds it: refused on every rank
        core = plan._plan
        first = core.inputs_of_buckets(core.ring_slots)
        late = next(i for i, (n, t) in enumerate(zoo) if i >= first and t.numel() > 4 and t.is_contiguous()
                    and all(u is not t for _, u in zoo[:i]))
        if rank == src:
            zoo[late][1].data = zoo[late][1].data.clone()
        before = [t.clone() for _, t in zoo]
        with pytest.raises(coalesced_bcast.AgreementError, match=f"rank {src} refused.*'{names[late]}'.*re-allocated"):
            plan.run()
        assert all(same_bits(t, b) for (_, t), b in zip(zoo, before)), "a refused run wrote something"
        plan.run(replan=True)
    # a shape change on the source (resize_ of a buffer): refused on every rank as well
    if rank == src:
        zoo[victim][1].resize_(1)
    with pytest.raises(coalesced_bcast.AgreementError, match=f"rank {src} refused.*changed shape"):
        plan.run()


@pytest.mark.parametrize("world_size", [2, 3])
def test_kept_plan_runs_again_and_refuses_changed_tensors(world_size):
    run_ranks(world_size, _reuse_body)


# speculate=True over each kind of agreement: a FileStore (no queues), a TCPStore with two ranks (the
# verdict through a queue) and with three (a counter), and the all_gather of larger groups.
@pytest.mark.parametrize("world_size,store,store_max", [(2, "file", None), (2, "tcp", None), (3, "tcp", None),
                                                        (2, "file", "0")])
def test_speculating_kept_plan_is_bitwise_and_refuses_as_before(world_size, store, store_max):
    run_ranks(world_size, _reuse_body, True, store_max, store=store)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _module_body(rank, world_size):
    torch.manual_seed(rank)
    net = _Net()
    plan = coalesced_bcast.plan_sync(net, src=0)
    for step in range(3):
        if rank == 0:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
            net.steps += 1
        stats = plan.run()
        got = torch.cat([t.detach().reshape(-1).double() for t in net.state_dict().values()])
        out = [torch.empty_like(got) for _ in range(world_size)]
        dist.all_gather(out, got)
        assert all(torch.equal(o, out[0]) for o in out), f"step {step}: ranks differ"
        assert int(net.steps) == step + 1 and net.b.weight is net.a.weight
        assert stats.unique_tensors == stats.tensors - 1  # the tie, sent once
    # a parameter replaced by a new object on rank 1: refused everywhere, naming it
    if rank == 1:
        net.a.bias = nn.Parameter(torch.zeros(8))
    with pytest.raises(coalesced_bcast.AgreementError, match="rank 1 refused.*'a.bias'.*replaced"):
        plan.run()
    plan.run(replan=True)
    out = [torch.empty(8) for _ in range(world_size)]
    dist.all_gather(out, net.a.bias.detach())
    assert all(torch.equal(o, out[0]) for o in out)


def test_kept_module_plan_sees_replaced_parameters():
    run_ranks(2, _module_body)


def _routes_body(rank, world_size):
    """Ranks lay one tensor out differently (contiguous on one, transposed on another): the first run
    agrees on routes every rank can take; later runs reuse them and stay bitwise."""
    big = torch.zeros(64, 64)
    if rank == 1:
        big = torch.zeros(64, 64).t().contiguous().t()  # same shape, other strides: another memory order
    small = torch.zeros(10)
    plan = coalesced_bcast.plan_sync([big, small], src=0, inplace_min_bytes=1024, bucket_bytes=4096)
    for step in range(3):
        if rank == 0:
            big.copy_(torch.arange(4096.0).view(64, 64) + step)
            small.fill_(step)
        stats = plan.run()
        assert torch.equal(big, torch.arange(4096.0).view(64, 64) + step), f"rank {rank} step {step}"
        assert torch.equal(small, torch.full((10,), float(step)))
        # both ranks could send it in place alone (rank 1 in its memory order), neither can here
        assert stats.inplace_tensors == 0 and stats.rerouted == 1, stats  # once, kept by the plan


def test_kept_plan_agrees_routes_once():
    run_ranks(2, _routes_body)


def test_speculating_kept_plan_packs_through_its_kept_ring():
    """A group of one rank: each run of a speculating kept plan packs the tensors' new values into the ring it
    kept (tests/test_gpu_single.py runs the same on a GPU, where the ring also keeps the copy table)."""
    from test_gpu_single import kept_table_body
    run_ranks(1, kept_table_body, "cpu")

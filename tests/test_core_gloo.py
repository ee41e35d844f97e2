"""The core over gloo on CPU: bitwise results for the whole zoo, modules, subgroups, memory bound."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks
from zoo import make_zoo, same_bits

# (bucket_bytes, ring_depth, inplace_min_bytes, coalesce_bytes): tiny buckets force splits and ring
# reuse; 0 in place sends everything through buckets; a low threshold sends most tensors in place.
OPTION_SETS = [
    (4096, 1, 1 << 40, 0),
    (4096, 3, 2048, 1 << 20),
    (65536, 2, 1 << 40, 0),
    (coalesced_bcast.DEFAULT_BUCKET_BYTES, coalesced_bcast.DEFAULT_RING_DEPTH,
     coalesced_bcast.DEFAULT_INPLACE_MIN_BYTES, coalesced_bcast.DEFAULT_COALESCE_BYTES),
]


def _zoo_body(rank, world_size):
    for case, (bucket, depth, inplace, coalesce) in enumerate(OPTION_SETS):
        for src in range(world_size):
            seed = 10 * case + src
            zoo = make_zoo(seed, torch.device("cpu"), 4096, value_seed=1000 + seed if rank == src else 5000 + rank)
            expected = make_zoo(seed, torch.device("cpu"), 4096, value_seed=1000 + seed)
            poisoned = [t.clone() for _, t in zoo]
            stats = coalesced_bcast.broadcast_tensors(
                [t for _, t in zoo], src, names=[n for n, _ in zoo], bucket_bytes=bucket, ring_depth=depth,
                inplace_min_bytes=inplace, coalesce_bytes=coalesce)
            wrong = [n for (n, t), (_, e) in zip(zoo, expected) if not same_bits(t, e)]
            assert not wrong, f"rank {rank} src {src} options {OPTION_SETS[case]}: wrong {wrong}"
            if rank != src:  # the poison really differed, so a sync that wrote nothing would fail
                assert sum(not same_bits(p, e) for p, (_, e) in zip(poisoned, expected)) > 100
            by_name = dict(zoo)
            assert by_name["tied.a"] is by_name["tied.b"]
            assert stats.tensors == len(zoo) and stats.unique_tensors == len(zoo) - 2
            assert stats.ring_bytes <= bucket * depth + 64 * stats.unique_tensors
            assert stats.buckets == 0 or stats.packed_bytes > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_zoo_bitwise(world_size):
    run_ranks(world_size, _zoo_body)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("inv_freq", torch.rand(8, dtype=torch.float64), persistent=False)
        self.register_buffer("nothing", None)


def _module_body(rank, world_size):
    torch.manual_seed(0)
    reference = Net()
    reference.norm.running_mean.uniform_()
    torch.manual_seed(rank if rank != 1 else 0)  # source is rank 1
    net = Net()
    if rank == 1:
        net.load_state_dict(reference.state_dict())
        net.inv_freq.copy_(reference.inv_freq)
    else:
        net.norm.running_mean.uniform_()
    versions = {n: p._version for n, p in net.named_parameters()}
    stats = coalesced_bcast.sync_module(net, src=1)
    for (n, a), (_, b) in zip(list(net.named_parameters()) + list(net.named_buffers()),
                              list(reference.named_parameters()) + list(reference.named_buffers())):
        assert same_bits(a.detach(), b.detach()), f"rank {rank}: {n}"
    assert net.head.weight is net.embed.weight
    for n, p in net.named_parameters():
        assert p.is_leaf and p.requires_grad and p.grad_fn is None, n
        if rank != 1:
            assert p._version > versions[n], f"{n}: version not bumped"
    assert stats.tensors == len(list(net.parameters())) + len(list(net.buffers())) + 1  # head.weight named twice
    net.lin(torch.randn(2, 16)).sum().backward()  # autograd still works
    assert net.lin.weight.grad is not None
    # include_buffers=False leaves buffers alone
    net.norm.running_var.fill_(float(rank))
    coalesced_bcast.sync_module(net, src=1, include_buffers=False)
    assert float(net.norm.running_var[0]) == float(rank)
    # an empty module and an empty list are no-ops, on every rank alike
    assert coalesced_bcast.sync_module(nn.Module(), src=0).unique_tensors == 0
    assert coalesced_bcast.broadcast_tensors([], src=0).bytes == 0


def test_sync_module_buffers_ties_autograd():
    run_ranks(2, _module_body)


def _subgroup_body(rank, world_size):
    group = dist.new_group([1, 2])
    t = torch.full((1000,), float(rank))
    if rank in (1, 2):
        coalesced_bcast.broadcast_tensors([t], src=2, group=group, bucket_bytes=4096)
        assert torch.equal(t, torch.full((1000,), 2.0))
        with pytest.raises(ValueError, match=r"src=0 is not a rank of the group.*on rank"):
            coalesced_bcast.broadcast_tensors([t], src=0, group=group)
    else:
        assert torch.equal(t, torch.zeros(1000))
    dist.barrier()


def test_subgroup_and_global_src():
    run_ranks(3, _subgroup_body)

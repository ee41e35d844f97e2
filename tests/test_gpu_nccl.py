"""The core over NCCL on 2 GPUs: bitwise, the memory rule on the Llama-8B state, stream order.

Skipped without 2 GPUs; run on the device machine (nvidia-h200-x2) by bench/device_run.sh.
"""
import pytest
import torch
import torch.distributed as dist

import coalesced_bcast
from dist_utils import run_ranks
from shapes import llama8b_shapes
from zoo import make_zoo, same_bits

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
MiB = 2**20


def _bitwise_and_order_body(rank, world_size):
    dev = torch.device("cuda", rank)
    for case, opts in enumerate([dict(bucket_bytes=4096, ring_depth=2, inplace_min_bytes=2048, coalesce_bytes=1 << 20),
                                 dict(bucket_bytes=65536, ring_depth=1, inplace_min_bytes=1 << 40),
                                 dict()]):
        for src in (0, 1):
            seed = 10 * case + src
            zoo = make_zoo(seed, dev, 4096, value_seed=1000 + seed if rank == src else 5000 + rank)
            expected = make_zoo(seed, dev, 4096, value_seed=1000 + seed)
            print(f"rank {rank}: zoo case {case} src {src}", flush=True)
            coalesced_bcast.broadcast_tensors([t for _, t in zoo], src, names=[n for n, _ in zoo], **opts)
            torch.cuda.synchronize()
            wrong = [n for (n, t), (_, e) in zip(zoo, expected) if not same_bits(t, e)]
            assert not wrong, f"rank {rank} src {src} case {case}: {wrong}"

    # Stream order, both ways, no synchronize anywhere. The source queues a long sleep and then the
    # write of its values on its current stream just before the call: the side streams must wait
    # for it. Receivers read the result on their current stream right after return: the current
    # stream must wait for the side streams. A user stream stands in for the current stream.
    n = 256 * MiB
    for use_user_stream in (False, True):
        stream = torch.cuda.Stream() if use_user_stream else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            tensors = [torch.full((n // 4 // 8,), -1.0, device=dev) for _ in range(8)]
            small = [torch.full((1000 + i,), -1.0, device=dev) for i in range(500)]
            new_values = [torch.full_like(t, 7.0 + i) for i, t in enumerate(tensors + small)]
            torch.cuda.synchronize()
            dist.barrier()
            if rank == 0:
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the values are written
                for t, v in zip(tensors + small, new_values):
                    t.copy_(v)
            coalesced_bcast.broadcast_tensors(tensors + small, src=0)
            copies = [t.clone() for t in tensors + small]  # queued on the current stream at once
        torch.cuda.synchronize()
        wrong = [i for i, (c, v) in enumerate(zip(copies, new_values)) if not torch.equal(c, v)]
        assert not wrong, f"rank {rank} user_stream={use_user_stream}: stale reads at {wrong[:5]}"

    # A tensor on a device the group's backend cannot serve: NCCL gets a CPU tensor. Every rank
    # refuses at the agreement; the core's own check (below it) is exercised directly too.
    with pytest.raises(ValueError, match=r"rank \d refused.*cpu.*no backend for cpu"):
        coalesced_bcast.broadcast_tensors([torch.zeros(3)], src=0, names=["cpu.w"])


def test_bitwise_stream_order_and_wrong_device():
    run_ranks(2, _bitwise_and_order_body, backend="nccl", timeout=300)


def _core_backend_check_body(rank, world_size):
    plan = coalesced_bcast._C.Plan([torch.zeros(3)], ["cpu.w"], 4096, 1, 1 << 40, 0, rank)
    with pytest.raises(ValueError, match=r"tensor 0 \('cpu.w'\) on rank \d is on cpu.*no backend for cpu"):
        plan.broadcast(dist.group.WORLD, 0)


def test_core_refuses_a_device_the_group_cannot_serve():
    """Below the agreement: the core's own check, with no Python in front of it."""
    run_ranks(2, _core_backend_check_body, backend="nccl", timeout=120)


def _memory_body(rank, world_size):
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in llama8b_shapes()]
    for t in tensors:
        if rank == 0:
            t.view(torch.int16).random_(generator=g)
        else:
            t.fill_(float("nan"))
    checks = [t.view(torch.int16).sum(dtype=torch.int64) for t in tensors] if rank == 0 else None
    for opts in (dict(), dict(inplace_min_bytes=1 << 40)):  # defaults, then everything through buckets
        torch.cuda.synchronize()
        base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        stats = coalesced_bcast.broadcast_tensors(tensors, src=0, **opts)
        torch.cuda.synchronize()
        extra_alloc = torch.cuda.max_memory_allocated() - base_alloc
        extra_res = torch.cuda.max_memory_reserved() - base_res
        ring = coalesced_bcast.DEFAULT_BUCKET_BYTES * coalesced_bcast.DEFAULT_RING_DEPTH
        assert stats.ring_bytes <= ring + MiB
        # slack: the agreement step's two 512-byte records and the allocator's 2 MiB small-pool segment
        assert extra_alloc <= stats.ring_bytes + MiB, (rank, opts, extra_alloc, stats.ring_bytes)
        assert extra_res <= stats.ring_bytes + 4 * MiB, (rank, opts, extra_res, stats.ring_bytes)
        assert torch.cuda.memory_allocated() == base_alloc, "ring not returned"
        sums = torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for t in tensors])
        ref = torch.stack(checks) if rank == 0 else torch.empty_like(sums)
        dist.broadcast(ref, 0)
        assert torch.equal(sums, ref), f"rank {rank} {opts}: checksums differ"
        print(f"rank {rank} {opts or 'defaults'}: extra allocated {extra_alloc / MiB:.1f} MiB, "
              f"reserved {extra_res / MiB:.1f} MiB, ring {stats.ring_bytes / MiB:.1f} MiB", flush=True)


def test_memory_rule_llama8b():
    run_ranks(2, _memory_body, backend="nccl", timeout=300)

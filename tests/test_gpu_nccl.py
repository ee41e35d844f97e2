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


def _load_body(rank, world_size):
    """load_full_state_dict through the engine on GPUs: DTensor shards (uneven Shard(0), Shard(1),
    Replicate), every kind of source (pinned, pageable, strided CPU, the source's GPU), casts with NaN
    payloads (bitwise as torch's CUDA copy_), a ring as the only extra memory."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dev = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world_size,))
    shapes = {"a": ((1001, 515), [Shard(0)], torch.bfloat16), "b": ((64, 3001), [Shard(1)], torch.bfloat16),
              "c": ((4099,), [Replicate()], torch.float32), "d": ((3, 5, 7), [Shard(2)], torch.float16),
              "big": ((3000, 1024), [Shard(0)], torch.bfloat16)}
    shapes.update({f"s{i}": ((100 + i,), [Shard(0)], torch.bfloat16) for i in range(300)})

    def model(cast: bool):
        m = nn.Module()
        for k, (shape, pl, dt) in shapes.items():
            dt = torch.bfloat16 if cast and dt == torch.float32 else dt
            m.register_parameter(k, nn.Parameter(distribute_tensor(torch.full(shape, -1.0, dtype=dt, device=dev),
                                                                   mesh, pl)))
        return m

    g = torch.Generator().manual_seed(11)
    full = {}
    for k, (shape, _, dt) in shapes.items():
        t = torch.empty(shape, dtype=dt)
        t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g,
                                                dtype=torch.uint8).view(t.view(torch.uint8).shape))
        full[k] = t
    for source in ("pinned", "pageable", "strided", "gpu", "mixed"):
        for cast in (False, True):
            m = model(cast)
            sd = None
            if rank == 0:
                if source == "pinned":
                    sd = {k: v.pin_memory() for k, v in full.items()}
                elif source == "pageable":
                    sd = dict(full)
                elif source == "strided":
                    sd = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in full.items()}
                elif source == "gpu":
                    sd = {k: v.to(dev) for k, v in full.items()}
                else:  # one bucket holds runs packed on the device, copied from pinned memory and staged
                    kinds = [lambda v: v.to(dev), lambda v: v.pin_memory(), lambda v: v]
                    sd = {k: kinds[i % 3](v) for i, (k, v) in enumerate(full.items())}
            torch.cuda.synchronize()
            base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            stats = coalesced_bcast.load_full_state_dict(m, sd, src=0, bucket_bytes=1 << 20, copy_threads=4)
            torch.cuda.synchronize()
            extra_alloc = torch.cuda.max_memory_allocated() - base_alloc
            extra_res = torch.cuda.max_memory_reserved() - base_res
            assert extra_alloc <= stats.ring_bytes + MiB, (source, cast, extra_alloc, stats.ring_bytes)
            assert extra_res <= stats.ring_bytes + 4 * MiB, (source, cast, extra_res, stats.ring_bytes)
            for k, (shape, pl, dt) in shapes.items():
                got = getattr(m, k)
                want = full[k].to(dev).to(got.dtype)  # torch's own CUDA cast
                want = distribute_tensor(want, mesh, pl)._local_tensor
                assert torch.equal(got._local_tensor.view(torch.uint8), want.view(torch.uint8)), \
                    f"rank {rank} source {source} cast {cast}: '{k}' differs"
            assert stats.cast_keys == (1 if cast else 0)
            print(f"rank {rank} load from {source} cast={cast}: {stats.buckets} buckets, extra allocated "
                  f"{extra_alloc / MiB:.1f} MiB, reserved {extra_res / MiB:.1f} MiB, host ring "
                  f"{stats.host_ring_bytes / MiB:.1f} MiB", flush=True)


def test_load_full_state_dict_on_gpus():
    run_ranks(2, _load_body, backend="nccl", timeout=300)


def _kept_plan_body(rank, world_size):
    """A kept plan on GPUs: 5 runs of new values, bitwise, no memory growth after the first."""
    dev = torch.device("cuda", rank)
    tensors = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in [(1000 + 17 * i,) for i in range(2000)]]
    tensors += [torch.zeros(4096, 1024, dtype=torch.bfloat16, device=dev)]
    plan = coalesced_bcast.plan_sync(tensors, src=0)
    for step in range(5):
        if rank == 0:
            for i, t in enumerate(tensors):
                t.view(torch.int16).fill_(step * 131 + i)
        if step == 1:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        plan.run()
        torch.cuda.synchronize()
        bad = [i for i, t in enumerate(tensors) if not bool((t.view(torch.int16) == step * 131 + i).all())]
        assert not bad, f"rank {rank} step {step}: {bad[:5]}"
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == base


def test_kept_plan_on_gpus():
    run_ranks(2, _kept_plan_body, backend="nccl", timeout=300)


def _speculating_plan_body(rank, world_size):
    """plan_sync(speculate=True) on GPUs: the first buckets cross ring to ring while the ranks agree. Runs of
    new values bitwise (one on another caller stream), no memory growth after the first (the ring is kept),
    a receiver's re-allocated tensor refused on every rank with nothing written, a source that replans
    drops what went early and sends again."""
    dev = torch.device("cuda", rank)
    tensors = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in [(1000 + 17 * i,) for i in range(2000)]]
    plan = coalesced_bcast.plan_sync(tensors, src=0, bucket_bytes=1 * MiB, speculate=True)

    def fill(step):
        if rank == 0:
            for i, t in enumerate(tensors):
                t.view(torch.int16).fill_(step * 131 + i)

    def check(step):
        torch.cuda.synchronize()
        bad = [i for i, t in enumerate(tensors) if not bool((t.view(torch.int16) == step * 131 + i).all())]
        assert not bad, f"rank {rank} step {step}: {bad[:5]}"

    side = torch.cuda.Stream(dev)
    for step in range(6):
        fill(step)
        if step == 1:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        if step == 3:  # the kept ring used from another stream than the one it was allocated on
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                stats = plan.run()
            torch.cuda.current_stream().wait_stream(side)
        else:
            stats = plan.run()
        check(step)
        assert stats.speculated == (2 if step > 0 else 0), (step, stats)
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == base
    before = [t.clone() for t in tensors]
    if rank == 1:
        tensors[7].data = tensors[7].data.clone()
        before[7] = tensors[7].clone()
    fill(9)
    if rank == 0:
        before = [t.clone() for t in tensors]
    with pytest.raises(coalesced_bcast.AgreementError, match="rank 1 refused.*re-allocated"):
        plan.run()
    torch.cuda.synchronize()
    assert all(same_bits(t, b) for t, b in zip(tensors, before)), f"rank {rank}: a refused run wrote something"
    plan.run(replan=True)
    check(9)
    if rank == 0:
        tensors[3].data = tensors[3].data.clone()
    for step in (10, 11):
        fill(step)
        stats = plan.run(replan=True)
        check(step)
        assert stats.speculated == (0 if step == 10 else 2), (step, stats)


def test_speculating_kept_plan_on_gpus():
    run_ranks(2, _speculating_plan_body, backend="nccl", timeout=300)


def _ring_before_agreement_body(rank, world_size):
    """The ring is made, and the source's first buckets packed, before the agreement (PreparedRun): when the
    agreement then fails, nothing is written, the ring goes back, and the next sync is bitwise; a rank that
    cannot make its ring refuses there, on every rank."""
    dev = torch.device("cuda", rank)
    tensors = [torch.full((1000 + i,), float(rank + 1), device=dev) for i in range(300)]
    extra = [torch.zeros(5, device=dev)] if rank == 1 else []  # one rank more: a mismatch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with pytest.raises(coalesced_bcast.AgreementError, match="source has 300 tensors, rank 1 has 301"):
        coalesced_bcast.broadcast_tensors(tensors + extra, src=0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base, "the ring made before a failed agreement was not returned"
    assert all(bool((t == rank + 1).all()) for t in tensors), f"rank {rank}: written before the agreement"
    prepare = coalesced_bcast._C.Plan.prepare
    if rank == 1:
        def no_memory(plan, is_src):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB (a test's refusal)")
        coalesced_bcast._C.Plan.prepare = no_memory
    try:
        with pytest.raises(coalesced_bcast.AgreementError, match="rank 1 could not make its ring"):
            coalesced_bcast.broadcast_tensors(tensors, src=0)
    finally:
        coalesced_bcast._C.Plan.prepare = prepare
    stats = coalesced_bcast.broadcast_tensors(tensors, src=0)
    torch.cuda.synchronize()
    assert stats.buckets > 0 and all(bool((t == 1).all()) for t in tensors), f"rank {rank} differs from the source"


def test_ring_before_agreement_on_gpus():
    run_ranks(2, _ring_before_agreement_body, backend="nccl", timeout=300)


def hsdp_same_outcome_body(rank, world_size, device_type="cuda"):
    """FSDP1 HYBRID_SHARD with sync_module_states on 2 ranks, meshes 1x2 (one replica sharded over both)
    and 2x1 (two replicas of one rank: FSDP1 falls back to NO_SHARD), once with torch's own sync and once
    with install(): the same parameters and buffers either way, and on 1x2 the source's, synced by
    coalesced_bcast. (On the CPU over gloo as well: tests/test_install_gloo.py runs it there.)"""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from test_install_gloo import SOURCE_SEED, Block, assert_same, build, states

    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    want = states(build(False, SOURCE_SEED, device=dev))
    for shape in ((1, 2), (2, 1)):
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        outcome, served = {}, 0
        for mode in ("torch", "install"):
            if mode == "torch" and device_type != "cuda":
                continue  # FSDP1 refuses CPU modules in sync_module_states without install()
            model = build(False, SOURCE_SEED if rank == 0 else 50 + rank, device=dev)
            coalesced_bcast.patched_calls(clear=True)
            with coalesced_bcast.installed() if mode == "install" else contextlib.nullcontext():
                fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=dev, sync_module_states=True,
                            sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
            with FSDP.summon_full_params(fsdp, writeback=False):
                outcome[mode] = states(fsdp)
            if mode == "install":
                calls = coalesced_bcast.patched_calls()
                assert all(c.fallback is None for c in calls), calls
                served = len(calls)
        if "torch" in outcome:
            assert_same(outcome["install"], outcome["torch"], f"HSDP mesh {shape}, install() against torch's", rank)
        if shape == (1, 2):
            assert served > 0
            assert_same(outcome["install"], want, f"HSDP mesh {shape}", rank)
        against = "same outcome as torch's" if "torch" in outcome else "torch's own refuses CPU modules"
        print(f"rank {rank}: HSDP mesh {shape}: {served} syncs served by coalesced_bcast, {against}", flush=True)


def test_hsdp_install_same_outcome_as_torch():
    run_ranks(2, hsdp_same_outcome_body, backend="nccl", timeout=300)


def test_load_into_fsdp2_cpu_offload_on_gpus():
    from test_gpu_single import offloaded_load_body
    run_ranks(2, offloaded_load_body, backend="nccl", timeout=300)

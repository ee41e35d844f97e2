"""Weight refit over NCCL on 2 GPUs, laid out as the issue's setup: a trainer of 2 ranks (GPU 0, GPU 1),
an engine process on GPU 1 joined to trainer rank 0 by its own group. Bitwise in the engine's dtype,
in place and through a callback, plans kept across steps, no synchronize between steps.

Skipped without 2 GPUs; run on the device machine (nvidia-h200-x2) by bench/device_run.sh.
"""
import faulthandler
import gc
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coalesced_bcast import RefitReceiver, RefitSender, init_refit_group
from test_refit_gloo import ENGINE, TRAINER, _Engine, _engine_name, _full_state, _wire
from zoo import same_bits

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard
from torch.distributed.device_mesh import DeviceMesh

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
DEVICE_OF_RANK = (0, 1, 1)  # trainer ranks on GPU 0 and 1, the engine beside trainer rank 1


def _wire_gpu(t):
    """The sender's cast as torch's CUDA copy_ makes it (NaN payloads differ from the CPU's vectorized cast)."""
    return _wire(t.cuda()).cpu()


def _entry(rank, world_size, path, fn, stateless):
    faulthandler.enable()
    torch.cuda.set_device(DEVICE_OF_RANK[rank])
    # No NCCL collective ever runs on the world (two of its ranks share a GPU): gloo there, NCCL in the subgroups.
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.FileStore(path, world_size), rank=rank,
                            world_size=world_size)
    try:
        fn(rank, stateless)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _run(fn, stateless=False, timeout=240):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(3, os.path.join(d, "store"), fn, stateless), nprocs=3, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s")


def _groups(rank, stateless):
    trainer = dist.new_group(list(TRAINER))
    if not stateless:
        return trainer, dist.new_group([TRAINER[0], ENGINE])
    world_store = dist.distributed_c10d._get_default_store()
    if rank == TRAINER[0]:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        world_store.set("refit_port", str(store.port))
        return trainer, init_refit_group(None, 0, 0, 2, device="cuda", store=store)
    if rank == ENGINE:
        store = dist.TCPStore("127.0.0.1", int(world_store.get("refit_port")), 2, False)
        return trainer, init_refit_group(None, 0, 1, 2, device="cuda", store=store)
    return trainer, None


def _dtensors(state, mesh, rank):
    out = {}
    for name, full in state.items():
        full = full.cuda()
        if full.dtype == torch.int64:
            out[name] = DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
        else:
            out[name] = DTensor.from_local(full.chunk(2, dim=0)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                           shape=full.shape, stride=full.stride())
    return out


def _update(dts, state, rank):
    for name, dt in dts.items():
        full = state[name].cuda()
        dt._local_tensor.copy_(full if full.dtype == torch.int64 else full.chunk(2, dim=0)[rank])


def _inplace_body(rank, stateless):
    trainer, refit = _groups(rank, stateless)
    if rank in TRAINER:
        dts = _dtensors(_full_state(0), DeviceMesh.from_group(trainer, "cuda"), rank)
        sender = RefitSender(dts, refit if rank == TRAINER[0] else None, dtype=torch.bfloat16, bucket_bytes=4096,
                             ring_depth=2)
        for step in range(4):
            _update(dts, _full_state(step), rank)  # queued on the current stream right before the send
            stats = sender.send(verify=step == 3)
            assert stats.planned == (step == 0)
    else:
        state = _full_state(0)
        dest = {k: torch.full(v.shape, 3, dtype=_wire(v).dtype, device="cuda") for k, v in state.items()}
        receiver = RefitReceiver(refit, tensors=dest, ring_depth=2)
        for step in range(4):
            receiver.receive()
            copies = {k: v.clone() for k, v in dest.items()}  # read at once, in stream order
            want = _full_state(step)
            wrong = [k for k, v in copies.items() if not same_bits(v.cpu(), _wire_gpu(want[k]))]
            assert not wrong, f"step {step}: {wrong}"
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("stateless", [False, True], ids=["new_group", "own_store"])
def test_refit_inplace_on_gpus(stateless):
    _run(_inplace_body, stateless)


def _callback_body(rank, stateless):
    trainer, refit = _groups(rank, stateless)
    if rank in TRAINER:
        dts = _dtensors(_full_state(0), DeviceMesh.from_group(trainer, "cuda"), rank)
        sender = RefitSender(dts, refit if rank == TRAINER[0] else None, dtype=torch.bfloat16, bucket_bytes=4096)
        for step in range(2):
            _update(dts, _full_state(step), rank)
            sender.send(verify=True)
    else:
        engine = _Engine().cuda()

        def on_weights(batch):
            engine.load_weights([(n, t) for n, t in ((_engine_name(n), t) for n, t in batch) if n is not None])
            for name, flat, first, _ in batch.pieces:
                engine.load_piece(_engine_name(name), flat, first)

        receiver = RefitReceiver(refit, on_weights=on_weights)
        for step in range(2):
            receiver.receive()
            want = {k: _wire_gpu(v) for k, v in _full_state(step).items()}
            layer = engine.layers[1]
            p = "model.layers.1."
            qkv = torch.cat([want[p + "self_attn.q_proj.weight"], want[p + "self_attn.k_proj.weight"],
                             want[p + "self_attn.v_proj.weight"]])
            assert same_bits(layer.qkv_proj.data.cpu(), qkv)
            assert same_bits(engine.lm_head.data.cpu(), want["lm_head.weight"])
    torch.cuda.synchronize()
    dist.barrier()


def test_refit_callback_on_gpus():
    _run(_callback_body)

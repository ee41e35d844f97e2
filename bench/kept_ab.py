"""A kept plan against the same plan with speculate=True, run alternately on the same tensors; the slowest
rank's median wall time per run (runs 4-39, each up to the device being done), every 8th run checked.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/kept_ab.py N ELEMS BUCKET_BYTES

N bf16 tensors of ELEMS elements; NCCL with one GPU per rank where there are enough GPUs, else gloo.
"""
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import coalesced_bcast
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402

device = dist_setup.init()
rank = dist.get_rank()
n, elems, bucket = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ts = [torch.full((elems,), float(rank == 0) * (i % 256), dtype=torch.bfloat16, device=device) for i in range(n)]
plans = {"kept": coalesced_bcast.plan_sync(ts, 0, bucket_bytes=bucket),
         "kept+speculate": coalesced_bcast.plan_sync(ts, 0, bucket_bytes=bucket, speculate=True)}
times = {k: [] for k in plans}
spec = []
cuda = device.type == "cuda"
for it in range(40):
    for k, p in plans.items():
        if rank != 0:
            for t in ts:
                t.zero_()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        st = p.run()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if it >= 4:
            times[k].append(dt)
        if k == "kept+speculate":
            spec.append(st.speculated)
        if it % 8 == 0 or it == 39:  # a check per tensor costs more than the run on GPUs: every 8th run
            bad = [i for i, t in enumerate(ts) if not bool((t == i % 256).all())]
            assert not bad, f"rank {rank} {k} run {it}: tensors {bad[:5]} differ"
worst = {}
for k, v in times.items():
    med = torch.tensor([statistics.median(v)], device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    worst[k] = med.item()
if rank == 0:
    print(f"{n} tensors x {elems} bf16, bucket {bucket >> 20} MiB, {torch.__version__}, "
          f"{dist.get_backend()} {dist.get_world_size()} ranks: " +
          ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in worst.items()) + f"; speculated buckets per run {spec[-1]}")
# The plans hold the group: let them go first (a gloo group that outlives destroy_process_group and dies at
# interpreter exit can abort the process: "terminate called without an active exception").
del plans, p, st
gc.collect()
time.sleep(0.05)
dist.destroy_process_group()

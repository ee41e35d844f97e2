"""Where an agreement's host time goes on this machine (issue 4: FSDP1's per-unit syncs).

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/agree_probe.py [--out FILE]

Back-to-back agreements for a Llama-8B block's 9 tensors, both ways (a collective over the group, NCCL
on GPUs and gloo on CPU, each of its steps timed on the host; and the group's c10d store); the same
right after a 0.4 GiB payload broadcast (which a collective agreement queues behind); and the bare
round trips of the store.
One JSON line per rank and case: median and p90 microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import coalesced_bcast  # noqa: E402
from coalesced_bcast import _C, agree  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402

N = 200


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs) * 1e6, 1), "p90_us": round(xs[int(0.9 * len(xs))] * 1e6, 1)}


def timed_steps():
    """Wrap the agreement's steps with host timers; returns (timers dict, undo)."""
    timers: dict[str, list[float]] = {}
    undo = []
    for name in ("all_gather", "to_host", "_record", "control_device", "_deadline"):
        fn = getattr(agree, name)

        def make(fn, name):
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timers.setdefault(name, []).append(time.perf_counter() - t0)
            return timed
        setattr(agree, name, make(fn, name))
        undo.append((name, fn))
    return timers, lambda: [setattr(agree, n, f) for n, f in undo]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "agree_probe.jsonl"))
    args = ap.parse_args()
    device = dist_setup.init()
    rank, pg = dist.get_rank(), dist.group.WORLD
    h, kv, inter = 4096, 1024, 14336
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    tensors = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    plan = _C.Plan(tensors, [], 32 << 20, 3, 4 << 20, 1 << 30, rank)
    rows = []

    def emit(case, xs, **extra):
        rows.append(dict(case=case, rank=rank, device=str(device), torch=torch.__version__, n=len(xs), **stats(xs), **extra))

    for how, store_max in (("collective", "0"), ("store", str(agree.STORE_MAX_RANKS))):
        os.environ[agree._STORE_ENV] = store_max
        for _ in range(20):
            agree.check_agreement(plan, None, pg, 0, [])
        # 1. back to back, nothing queued before
        timers, undo = timed_steps()
        xs = []
        for _ in range(N):
            t0 = time.perf_counter()
            agree.check_agreement(plan, None, pg, 0, [])
            xs.append(time.perf_counter() - t0)
        undo()
        emit(f"agreement_alone[{how}]", xs, steps={k: stats(v) for k, v in timers.items()})
        # 2. right after a payload broadcast of the same 9 tensors (0.4 GiB): what FSDP1 does unit after unit
        xs, ys = [], []
        for _ in range(50):
            t0 = time.perf_counter()
            coalesced_bcast.broadcast_tensors(tensors, 0)
            t1 = time.perf_counter()
            agree.check_agreement(plan, None, pg, 0, [])
            xs.append(time.perf_counter() - t1)
            ys.append(t1 - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        emit(f"agreement_after_payload[{how}]", xs, sync_us=stats(ys))
    del os.environ[agree._STORE_ENV]
    # 3. the group's store: the round trips a store-based agreement would take (publish, read, count, wait)
    store = dist.distributed_c10d._get_process_group_store(pg)
    dist.barrier()
    xs = []
    for i in range(N):
        t0 = time.perf_counter()
        k = f"agree_probe/{i}/"
        if rank == 0:
            store.set(k + "src", b"x" * 48)
        store.wait([k + "src"], timedelta(seconds=30))
        store.get(k + "src")
        n = store.add(k + "arrived", 1)
        if n == dist.get_world_size():
            store.set(k + "done", str(n))
        store.wait([k + "done"], timedelta(seconds=30))
        store.get(k + "done")
        xs.append(time.perf_counter() - t0)
    emit("store_round_trips_5", xs, store=type(store).__name__)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if rank == 0:
        with open(args.out, "w") as f:
            for rr in every:
                for r in rr:
                    f.write(json.dumps(r) + "\n")
                    print(json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

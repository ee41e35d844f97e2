"""What judging FSDP2's load post-hooks costs (csrc/post_hooks.cpp): the walk that lists them (HookJudgment's
constructor), the verdict over them, and both in one call (post_hooks_idle), on warm objects, best of --iters.
Two layouts of 16,384 parameters: one module holding them all (--layout one, nn.ParameterList: the load
benches' small16k state) and 8,192 modules of two each (--layout many, weight and bias of nn.Linear: a
Mixture-of-Experts model's per-expert modules). A/B: run it with PYTHONPATH at each build, alternating.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/hooks_judgment.py [--layout many]
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dist_setup
from coalesced_bcast import _C


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=("one", "many"), default="one")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    device = dist_setup.init()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    sizes = torch.randint(256, 65536, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.device("meta"):
        if a.layout == "one":
            model = nn.ParameterList([nn.Parameter(torch.empty(n)) for n in sizes])
        else:
            model = nn.Sequential(*[nn.Linear(64, 8) for _ in range(8192)])
    fully_shard(model.to(torch.bfloat16), mesh=mesh)
    model.to_empty(device=device)
    rows = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        idle = _C.post_hooks_idle(model)
        t1 = time.perf_counter()
        judgment = _C.HookJudgment(model)
        t2 = time.perf_counter()
        assert judgment.verdict() is idle is True
        rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    best = [min(r[i] for r in rows) * 1e3 for i in range(3)]
    if dist.get_rank() == 0:
        print(f"layout {a.layout}, 16384 parameters, best of {a.iters}: post_hooks_idle {best[0]:.1f} ms, "
              f"walk {best[1]:.1f} ms, verdict {best[2]:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

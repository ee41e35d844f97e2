"""Where a load's host time goes: cProfile of load_full_state_dict on rank 0 for an FSDP2 model of many
small tensors (default 16,384), the source state pinned on rank 0's CPU.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_load.py [--count N] [--out FILE]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import coalesced_bcast
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = dist_setup.init()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    sizes = torch.randint(256, 65536, (args.count,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.device("meta"):
        model = nn.ParameterList([nn.Parameter(torch.empty(n)) for n in sizes]).to(torch.bfloat16)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    sd = None
    if dist.get_rank() == 0:
        pin = device.type == "cuda"
        sd = {k: torch.zeros(v.shape, dtype=torch.bfloat16, pin_memory=pin) for k, v in model.state_dict().items()}
    for _ in range(2):  # warm-up
        coalesced_bcast.load_full_state_dict(model, sd)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    coalesced_bcast.load_full_state_dict(model, sd)
    prof.disable()
    wall = time.perf_counter() - t0
    if dist.get_rank() == 0:
        s = io.StringIO()
        s.write(f"load of {args.count} keys, profiled: {wall:.3f} s\n")
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
        print(s.getvalue(), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(s.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

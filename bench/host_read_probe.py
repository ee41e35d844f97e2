"""Where a 16k-key load's copies of small pinned runs lose the copy engine's rate: the same 1 GiB state from
pinned memory as 16,384 allocations of their own (as `torch.zeros(..., pin_memory=True)` per tensor makes them)
and as views of one pinned buffer, loaded into one FSDP2 model (1-rank mesh); for each, the load's time from its
transfer call to its last copy (the phases after the transfer is queued) and the whole load; beside them the copy
engine's rate for one 1 GiB copy and for one copy per tensor of the separate allocations, and the host's NUMA
facts. Medians of --reps loads, ms.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/host_read_probe.py
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402
import profile_load  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import coalesced_bcast  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=5)
a = p.parse_args()
device = dist_setup.init()
assert device.type == "cuda", "a GPU probe"
mesh = init_device_mesh("cuda", (1,))
sizes = torch.randint(256, 65536, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
with torch.device("meta"):
    model = nn.ParameterList([nn.Parameter(torch.empty(n)) for n in sizes]).to(torch.bfloat16)
fully_shard(model, mesh=mesh)
model.to_empty(device=device)
keys = list(model.state_dict().keys())
separate = {k: torch.full((n,), 1.0, dtype=torch.bfloat16, pin_memory=True) for k, n in zip(keys, sizes)}
flat = torch.full((sum(sizes),), 1.0, dtype=torch.bfloat16, pin_memory=True)
one_buffer, off = {}, 0
for k, n in zip(keys, sizes):
    one_buffer[k] = flat[off:off + n]
    off += n


def load_ms(sd):
    whole, after = [], []
    for _ in range(a.reps + 1):
        with profile_load.phase_timers() as ph:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            coalesced_bcast.load_full_state_dict(model, sd)
            torch.cuda.synchronize()
            whole.append((time.perf_counter() - t0) * 1e3)
        after.append(sum(ph.get(k, 0.0) for k in ("_transfer", "_run_post_hooks", "host_reads_wait")) * 1e3)
    return statistics.median(whole[1:]), statistics.median(after[1:])


dst = torch.empty(flat.numel(), dtype=torch.bfloat16, device=device)
print(f"one 1 GiB copy by the copy engine (the one buffer): {dist_setup.best_ms(lambda: dst.copy_(flat, non_blocking=True), True):.1f} ms")
def per_tensor():
    o = 0
    for t in separate.values():
        dst[o:o + t.numel()].copy_(t, non_blocking=True)
        o += t.numel()
print(f"a copy per tensor by the copy engine (separate allocations): {dist_setup.best_ms(per_tensor, True, 2):.1f} ms")
for name, sd in [("separate allocations", separate), ("views of one buffer", one_buffer)] * 2:  # alternating
    w, t = load_ms(sd)
    print(f"load from {name}: whole {w:.1f} ms, transfer call to last copy {t:.1f} ms", flush=True)
for cmd in (["numactl", "-H"], ["nvidia-smi", "topo", "-m"]):
    try:
        print(subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout)
    except Exception as e:  # a tool this machine lacks
        print(f"{cmd[0]}: {e}")
dist.destroy_process_group()

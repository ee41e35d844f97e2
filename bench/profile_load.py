"""Where a load's host time goes: cProfile of load_full_state_dict on rank 0 for an FSDP2 model of many
small tensors (default 16,384), the source state pinned on rank 0's CPU; with --phases, no profiler:
the wall time of each phase of the load (state_dict.py's functions), the last of 4 loads.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_load.py [--count N] [--phases] [--out FILE]

--timeline: each rank's phases of one load against a common clock, to see which rank the others wait for.
"""
import argparse
import contextlib
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
    ap.add_argument("--phases", action="store_true", help="time each phase instead of profiling")
    ap.add_argument("--timeline", action="store_true",
                    help="each rank's phases as start-end ms from a common start (after a barrier), the last of 4 loads")
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
    if args.phases or args.timeline:
        (timeline if args.timeline else phases)(model, sd, args)
        dist.destroy_process_group()
        return
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


# host_reads_wait: the source waits for its copies of host memory, after the post-hooks ran beside them.
# _prepare: the ring made and the source's first buckets packed, before the agreement.
PHASES = ["_model_device", "_describe_source", "_broadcast_meta", "_plan_local", "_prepare", "_agree", "_transfer",
          "_run_post_hooks", "host_reads_wait"]


@contextlib.contextmanager
def _wrapped(names, around):
    """Inside: each of state_dict.py's functions `names` runs as around(name, call) runs it."""
    from coalesced_bcast import state_dict as S
    originals = {name: getattr(S, name) for name in names if hasattr(S, name)}  # (an older tree may lack some)

    def wrap(name, fn):
        return lambda *a, **kw: around(name, lambda: fn(*a, **kw))

    for name, fn in originals.items():
        setattr(S, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(S, name, fn)


@contextlib.contextmanager
def phase_ranges():
    """Inside: each of state_dict.py's phases (and the model's state_dict()) runs under a profiler range of its
    own name, so that a torch.profiler trace shows where the host was while the GPU worked."""
    def ranged(name, call):
        with torch.profiler.record_function(name):
            return call()

    with _wrapped(PHASES + ["_walk_modules"], ranged):
        yield


@contextlib.contextmanager
def phase_timers():
    """Inside: state_dict.py's phases wrapped with timers; yields {phase: seconds}, summed over the loads
    made inside (bench/fsdp2_load.py --phases uses it too)."""
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(name, call):
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            spent[name] += time.perf_counter() - t0

    with _wrapped(PHASES, timed):
        yield spent


@contextlib.contextmanager
def phase_spans():
    """Inside: state_dict.py's phases (and the module walk) wrapped to record (name, start, end) in wall-clock
    seconds, which processes on one host share; yields the list."""
    spans: list = []

    def spanned(name, call):
        t0 = time.time()
        try:
            return call()
        finally:
            spans.append((name, t0, time.time()))

    with _wrapped(PHASES + ["_walk_modules"], spanned):
        yield spans


def timeline(model, sd, args):
    """Each rank's phases of one load (the last of 4) as start-end ms from the moment all ranks left a barrier:
    where one rank waits for another (the metadata, the agreement) shows as a gap in the waiting rank's work."""
    for _ in range(4):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        with phase_spans() as spans:
            t0 = time.time()
            coalesced_bcast.load_full_state_dict(model, sd)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            end = time.time()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (t0, end, spans))
    if dist.get_rank() == 0:
        start = min(t for t, _, _ in everyone)
        lines = [f"load of {args.count} keys over {dist.get_world_size()} ranks ({torch.__version__}), one load's "
                 f"phases per rank, ms from the common start"]
        for r, (t, e, sp) in enumerate(everyone):
            lines.append(f"rank {r}: entered {1e3 * (t - start):.1f}, returned {1e3 * (e - start):.1f}")
            lines += [f"  {name:18s} {1e3 * (a - start):8.1f} - {1e3 * (b - start):8.1f} ({1e3 * (b - a):.1f})"
                      for name, a, b in sorted(sp, key=lambda x: x[1])]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)


def phases(model, sd, args):
    """Each phase's wall time, the last of 4 loads."""
    for _ in range(4):
        with phase_timers() as spent:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            coalesced_bcast.load_full_state_dict(model, sd)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    if dist.get_rank() == 0:
        n = args.count
        lines = [f"load of {n} keys over {dist.get_world_size()} ranks ({torch.__version__}): {wall * 1e3:.1f} ms, "
                 f"{wall / n * 1e6:.2f} us per key"]
        lines += [f"  {k:18s} {v * 1e3:8.1f} ms {v / n * 1e6:6.2f} us/key" for k, v in spent.items()]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()

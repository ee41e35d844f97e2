"""Where a kept plan's time goes on the GPUs: each stream's kernels under torch.profiler, beside the
same bytes broadcast in pieces from one buffer.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/trace_pipeline.py --out DIR

Per case and method: the best of --reps timed runs (host wall time to the device being done, no
empty_cache between runs: a loop that sends the same tensors again), then one profiled run whose
kernels are summarized per rank: NCCL kernels (count, mean duration, the idle gaps between them on
their stream), copy kernels (count, mean duration, the share of their time that overlaps an NCCL
kernel) and the span from the first kernel to the last. Writes DIR/trace_summary.txt and
DIR/trace_summary.jsonl; the raw traces as DIR/trace_<case>_<method>_rank<r>.json with --keep-traces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import coalesced_bcast  # noqa: E402
from shapes import small_shapes  # noqa: E402

import dist_setup  # noqa: E402  (beside this script)

MiB = 2**20
TIMELINES = ()


def states(device) -> dict:
    return {
        # the bench's 16k case: 1-D bf16 tensors of 0.5-128 KiB, about 1 GiB
        "small16k": [torch.empty(s, dtype=torch.bfloat16, device=device) for s in small_shapes()],
        # a refit's expert matrices (Qwen3-30B-A3B: 2048x768 bf16, 3 MiB each), 3 GiB
        "experts3M": [torch.empty(2048, 768, dtype=torch.bfloat16, device=device) for _ in range(1024)],
    }


def kept(ts, **kw):
    plan = coalesced_bcast.plan_sync(ts, 0, **kw)
    return lambda: plan.run()


def pieces(nbytes, piece, device):
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    parts = flat.split(piece) if piece else [flat]
    return lambda: [dist.broadcast(p, 0) for p in parts]


def methods(case, ts, device) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    m = {"flat": pieces(nbytes, None, device), "pieces32M": pieces(nbytes, 32 * MiB, device),
         "pieces64M": pieces(nbytes, 64 * MiB, device)}
    m["pieces128M"] = pieces(nbytes, 128 * MiB, device)
    m["pieces256M"] = pieces(nbytes, 256 * MiB, device)
    m["oneshot"] = lambda: coalesced_bcast.broadcast_tensors(ts, 0)
    for mb in (32, 64, 128, 256):
        for depth in (2, 3):
            m[f"kept[{mb}Mx{depth}]"] = kept(ts, bucket_bytes=mb * MiB, ring_depth=depth)
    m["kept[128Mx2, speculate]"] = kept(ts, bucket_bytes=128 * MiB, ring_depth=2, speculate=True)
    if case == "small16k":
        m["kept[timeout=60s]"] = kept_timeout(ts, 60.0)
    return m


def kept_timeout(ts, seconds):
    """A kept plan run with a deadline: the host queues a few buckets ahead only (the throttle) and waits
    for the payload's end."""
    plan = coalesced_bcast.plan_sync(ts, 0)
    return lambda: plan.run(timeout=seconds)


def best_time(fn, reps) -> tuple[float, dict]:
    """Best wall time, and for ours the host phases of that run (ms)."""
    best, phases = float("inf"), {}
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        if sec < best:
            best = sec
            if isinstance(out, coalesced_bcast.SyncStats):
                phases = {k: round(getattr(out, k + "_seconds") * 1e3, 3) for k in ("plan", "agree", "enqueue")}
    return best, phases


def timeline(events: list, kernels: list, limit: int = 40) -> list[str]:
    """The first `limit` kernels: start (device) relative to the first one, duration, stream, and how long
    after its host-side launch call it started (small: the device waited for the host)."""
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    t0 = kernels[0]["ts"]
    out = []
    for k in kernels[:limit]:
        lt = launch.get(k.get("args", {}).get("correlation"))
        lag = f"{k['ts'] - lt:8.1f}" if lt is not None else "       -"
        host = f"{lt - t0:9.1f}" if lt is not None else "        -"
        out.append(f"{k['ts'] - t0:9.1f} {k['dur']:7.1f} s{k.get('args', {}).get('stream', '?'):<3} host{host} "
                   f"lag{lag} {k['name'][:48]}")
    return out


def summarize(trace_path: str, lines: list | None = None) -> dict:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {}
    if lines is not None:
        lines.extend(timeline(events, kernels))
    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    copies = [e for e in kernels if "nccl" not in e["name"].lower()]
    out = {"kernels": len(kernels), "span_us": max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"],
           "nccl": len(nccl), "copies": len(copies)}
    if nccl:
        out["nccl_mean_us"] = sum(e["dur"] for e in nccl) / len(nccl)
        out["nccl_busy_us"] = sum(e["dur"] for e in nccl)
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(nccl, nccl[1:])]
        out["nccl_gap_sum_us"] = sum(max(g, 0) for g in gaps)
        out["nccl_gap_mean_us"] = out["nccl_gap_sum_us"] / max(len(gaps), 1)
        out["nccl_gap_max_us"] = max(gaps, default=0)
    if copies:
        out["copy_mean_us"] = sum(e["dur"] for e in copies) / len(copies)
        out["copy_busy_us"] = sum(e["dur"] for e in copies)
        overlap = 0.0
        for c in copies:
            c0, c1 = c["ts"], c["ts"] + c["dur"]
            overlap += sum(max(0.0, min(c1, n["ts"] + n["dur"]) - max(c0, n["ts"])) for n in nccl)
        out["copy_overlap_pct"] = 100.0 * overlap / max(out["copy_busy_us"], 1e-9)
        names = {}
        for c in copies:
            names.setdefault(c["name"][:60], []).append(c["dur"])
        out["copy_kinds"] = {k: [len(v), sum(v) / len(v)] for k, v in names.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/trace")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cases", default="small16k,experts3M")
    ap.add_argument("--keep-traces", action="store_true")
    args = ap.parse_args()
    device = dist_setup.init()
    assert device.type == "cuda", "trace_pipeline needs GPUs"
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    all_states = states(device)
    for case in args.cases.split(","):
        ts = all_states[case]
        for name, fn in methods(case, ts, device).items():
            fn()  # plan, warm the communicator's paths
            sec, phases = best_time(fn, args.reps)
            torch.cuda.synchronize()
            dist.barrier()
            path = os.path.join(args.out, f"trace_{case}_{name.replace('[', '_').replace(']', '')}_rank{rank}.json")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(path)
            lines = [] if case == "small16k" and name in TIMELINES else None
            row = dict(case=case, method=name, rank=rank, best_us=sec * 1e6, host_ms=phases, **summarize(path, lines))
            if lines:
                row["timeline"] = lines
            if not args.keep_traces:
                os.remove(path)
            rows.append(row)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        flat = sorted((r for g in gathered for r in g), key=lambda r: (r["case"], r["method"], r["rank"]))
        with open(os.path.join(args.out, "trace_summary.jsonl"), "w") as f:
            for r in flat:
                f.write(json.dumps(r) + "\n")
        lines = [f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, torch {torch.__version__}, NCCL "
                 f"{'.'.join(map(str, torch.cuda.nccl.version()))}; best of {args.reps}; kernels from one profiled run",
                 f"{'case':>10} {'method':>18} {'rk':>2} {'best us':>9} {'span us':>9} {'nccl':>5} {'mean':>7} "
                 f"{'gaps':>8} {'gapmax':>7} {'copies':>6} {'mean':>7} {'ovl%':>5} host ms plan/agree/enqueue"]
        for r in flat:
            lines.append(f"{r['case']:>10} {r['method']:>18} {r['rank']:>2} {r['best_us']:>9.1f} "
                         f"{r.get('span_us', 0):>9.1f} {r.get('nccl', 0):>5} {r.get('nccl_mean_us', 0):>7.1f} "
                         f"{r.get('nccl_gap_sum_us', 0):>8.1f} {r.get('nccl_gap_max_us', 0):>7.1f} "
                         f"{r.get('copies', 0):>6} {r.get('copy_mean_us', 0):>7.1f} {r.get('copy_overlap_pct', 0):>5.1f} "
                         f"{'/'.join(str(v) for v in r['host_ms'].values()) or '-'}")
        for r in flat:
            if r.get("timeline"):
                lines.append(f"--- {r['case']} {r['method']} rank {r['rank']}: start dur stream host-launch lag name (us)")
                lines.extend(r.pop("timeline"))
        for r in flat:
            if r.get("copy_kinds"):
                lines.append(f"{r['case']} {r['method']} rank {r['rank']}: {json.dumps(r['copy_kinds'])}")
        with open(os.path.join(args.out, "trace_summary.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Host cost of planning and of a kept plan's check, per tensor, on one process (no communication).

For N small tensors (64 KiB each, on the GPU when there is one): building the plan from Python
(`_C.Plan`: the list's conversion, the per-tensor pass, dedup, routes, the copy table) and a kept
plan's `check_unchanged`, best and median of `--iters`, in ns per tensor. The tensors are made as
a model's would be: interleaved with other allocations, so their TensorImpls are not back to back.

    python bench/plan_host.py --counts 4096,16384,65536 --out plan_host.jsonl [--label new] [--cold]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

try:  # the package on PYTHONPATH (an A/B run points it at another build), else this checkout's
    from coalesced_bcast import _C
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    from coalesced_bcast import _C
from coalesced_bcast.sync import DEFAULT_BUCKET_BYTES, DEFAULT_RING_DEPTH  # noqa: E402


def timed(fn, iters: int, before=None) -> list[float]:
    out = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--counts", default="4096,16384,65536")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--elems", type=int, default=32768, help="bf16 elements per tensor")
    p.add_argument("--interop", type=int, default=0, help="torch inter-op threads (0: torch's default)")
    p.add_argument("--cold", action="store_true", help="sweep 256 MiB of host memory before each timed call, so "
                   "that the tensors' objects are out of the caches as on a one-shot call (else warm from the last)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.interop:
        torch.set_num_interop_threads(a.interop)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gc.disable()
    rows = []
    for n in (int(c) for c in a.counts.split(",")):
        ts, other = [], []
        for i in range(n):
            ts.append(torch.empty(a.elems, dtype=torch.bfloat16, device=device))
            other.append(torch.empty(1))  # other host objects between the tensors' own
        opts = (DEFAULT_BUCKET_BYTES, DEFAULT_RING_DEPTH, 4 << 20, 1 << 30, 0)
        plan = _C.Plan(ts, [], *opts)
        sweep = torch.empty(256 << 20, dtype=torch.uint8) if a.cold else None
        evict = (lambda: sweep.add_(1)) if a.cold else None
        make = timed(lambda: _C.Plan(ts, [], *opts), a.iters, evict)
        check = timed(plan.check_unchanged, a.iters, evict)
        assert plan.check_unchanged() == ""
        row = {"case": "plan_host", "label": a.label, "cold": a.cold, "package": os.path.dirname(_C.__file__), "tensors": n, "device": str(device),
               "torch": torch.__version__, "interop_threads": torch.get_num_interop_threads(),
               "plan_grain": os.environ.get("COALESCED_BCAST_PLAN_GRAIN", "8192"),
               "cpu_count": os.cpu_count(),
               "plan_ns_per_tensor_best": min(make) / n * 1e9,
               "plan_ns_per_tensor_median": statistics.median(make) / n * 1e9,
               "check_ns_per_tensor_best": min(check) / n * 1e9,
               "check_ns_per_tensor_median": statistics.median(check) / n * 1e9,
               "plan_ms_best": min(make) * 1e3, "check_ms_best": min(check) * 1e3}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del ts, other, plan
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

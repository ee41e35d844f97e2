"""The pack and unpack kernels alone, on one GPU, no communication.

    python3 bench/copy_kernels.py [--cases small16k,experts3M,mixed,moe,cnn] [-b BUCKET_BYTES] [-n ITERS]
                                  [--label L] [--out FILE.jsonl]

Per case (bench.py's states, every tensor through the buckets): one plan packs the state into a slot
bucket by bucket, a second plan over tensors of the same layout unpacks it (`_C._copy_buckets`, the
executor the broadcast uses). Times are the best of ITERS over all buckets of a state, CUDA events on
the caller's stream (the table's upload included), beside a device-to-device copy of the same bytes in
bucket-sized pieces (`copy`: what a plain memcpy gets). GB/s counts the state's bytes once. #wrong: the
unpacked state differs from the packed one (bitwise).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from coalesced_bcast import _C  # noqa: E402
from coalesced_bcast.sync import DEFAULT_BUCKET_BYTES, DEFAULT_RING_DEPTH  # noqa: E402

import bench as states  # noqa: E402  (bench.py beside this script: the states)

MiB = 2**20


def experts3m():
    """A refit's expert matrices (Qwen3-30B-A3B: 2048x768 bf16, 3 MiB each), 3 GiB."""
    return [(f"e{i}", torch.bfloat16, (2048, 768), None) for i in range(1024)]


def timed(fn, iters: int) -> float:
    """Best seconds of `iters` calls, between CUDA events on the current stream."""
    best = float("inf")
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def run_case(name: str, spec: list, bucket_bytes: int, iters: int, device: torch.device) -> dict:
    src, dst = states.build(spec, device), states.build(spec, device)
    states.fill(src, seed=5, poison=False)
    states.fill(dst, seed=0, poison=True)
    plans = [_C.Plan(ts, [], bucket_bytes, DEFAULT_RING_DEPTH, 1 << 50, 1 << 30, 0) for ts in (src, dst)]
    slot = torch.empty(plans[0].slot_bytes, dtype=torch.uint8, device=device)
    every = list(range(plans[0].num_buckets))
    for k in every:  # correctness (and warm-up): every bucket packed, then unpacked into the other state
        _C._copy_buckets(plans[0], True, slot, [k])
        _C._copy_buckets(plans[1], False, slot, [k])
    wrong = int(not states.check(dst, seed=5))
    nbytes = plans[0].packed_bytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pieces = flat.split(plans[0].slot_bytes)
    pack = timed(lambda: _C._copy_buckets(plans[0], True, slot, every), iters)
    unpack = timed(lambda: _C._copy_buckets(plans[1], False, slot, every), iters)
    copy = timed(lambda: [slot[:p.numel()].copy_(p) for p in pieces], iters)
    unique = {id(t): t for t in src}.values()
    return dict(case=name, bytes=nbytes, count=len(unique), buckets=len(every), bucket_bytes=bucket_bytes,
                pack_us=pack * 1e6, unpack_us=unpack * 1e6, copy_us=copy * 1e6, pack_gbps=nbytes / pack / 1e9,
                unpack_gbps=nbytes / unpack / 1e9, copy_gbps=nbytes / copy / 1e9, wrong=wrong)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="small16k,experts3M,mixed,moe,cnn")
    p.add_argument("-b", "--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    specs = dict(states.cases(on_gpu=True), experts3M=experts3m())
    head = (f"{'case':>10} {'size(B)':>12} {'count':>6} {'bkts':>5} {'pack us':>9} {'GB/s':>7} {'unpack us':>9} "
            f"{'GB/s':>7} {'copy us':>9} {'GB/s':>7} {'#wrong':>6}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bucket {a.bucket_bytes >> 20} MiB, "
          f"best of {a.iters}{', ' + a.label if a.label else ''}")
    print(head)
    for name in a.cases.split(","):
        r = run_case(name, specs[name], a.bucket_bytes, a.iters, device)
        r.update(label=a.label, device=torch.cuda.get_device_name(), torch=torch.__version__)
        print(f"{name:>10} {r['bytes']:>12} {r['count']:>6} {r['buckets']:>5} {r['pack_us']:>9.1f} "
              f"{r['pack_gbps']:>7.1f} {r['unpack_us']:>9.1f} {r['unpack_gbps']:>7.1f} {r['copy_us']:>9.1f} "
              f"{r['copy_gbps']:>7.1f} {r['wrong']:>6}", flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The process group of a benchmark run under torchrun: NCCL with one GPU per rank where there are
enough GPUs (and the CPU was not asked for), else gloo on the CPU."""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def init(cpu: bool = False, timeout: Optional[timedelta] = None) -> torch.device:
    """Initializes the default group and returns this rank's device."""
    kw = {} if timeout is None else {"timeout": timeout}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not cpu and torch.cuda.is_available() and torch.cuda.device_count() >= world:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kw)
    return device


def timed(fn, cuda: bool):
    """fn() after a barrier (every rank starts together): (its result, wall seconds up to the device being
    done, peak bytes allocated and reserved above the start on this rank, 0 without CUDA)."""
    def sync():
        if cuda:
            torch.cuda.synchronize()
    sync()
    dist.barrier()
    sync()
    base_a = base_r = 0
    if cuda:
        torch.cuda.empty_cache()
        base_a, base_r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    sync()
    sec = time.perf_counter() - t0
    if not cuda:
        return out, sec, 0, 0
    return out, sec, torch.cuda.max_memory_allocated() - base_a, torch.cuda.max_memory_reserved() - base_r


def best_ms(fn, cuda: bool, n: int = 5) -> float:
    """The best wall time of n calls of fn(), each up to the device being done, in ms (no barrier: one rank's
    own work, such as a copy or a host call alone)."""
    best = float("inf")
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def table(columns: list[tuple[str, int]], rows: list[tuple]) -> str:
    """A fixed-width table, nccl-tests style: columns are (header, width), each cell right-aligned; a float
    cell is printed with 2 decimals (or as given, when the caller formats it), None as '-'."""
    def cell(v, w):
        if v is None:
            v = "-"
        elif isinstance(v, bool):
            v = "yes" if v else "NO"
        elif isinstance(v, float):
            v = f"{v:.2f}"
        return f"{v:>{w}}"
    lines = [" ".join(f"{h:>{w}}" for h, w in columns)]
    lines += [" ".join(cell(v, w) for v, (_, w) in zip(r, columns)) for r in rows]
    return "\n".join(lines)

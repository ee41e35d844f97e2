"""Safety checks that need GPUs, each a mode; on CPU each runs reduced, over gloo.

    # 1,000 syncs of a mixed model: no memory growth after the first, no error
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/soak.py --out soak.jsonl
    # verify on the GPU: GPU hash == CPU hash bit for bit, a flipped bit caught, its cost for 16k small
    # tensors (1 GiB) and a Llama-8B-shaped state (15 GiB); wrong-device input refused over NCCL
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/soak.py --mode gpu-checks --out g.jsonl
    # a rank that never arrives / dies / stalls: the survivor must stop within the timeout (own processes)
    python3 bench/soak.py --mode timeout --out timeout.jsonl
    # the workload that bench/sanitize.sh runs under compute-sanitizer
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/soak.py --mode sanitize

Every mode writes JSON lines (one per rank, or per case) to --out (default $OUT/soak-MODE.jsonl or
stdout) and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import coalesced_bcast  # noqa: E402
from coalesced_bcast import AgreementError  # noqa: E402
from coalesced_bcast.verify import VerifyError, tensor_hashes, verify_tensors  # noqa: E402
from zoo import fill_random_bytes, make_zoo, same_bits  # noqa: E402

import dist_setup  # noqa: E402  (beside this script)

GiB, MiB = 2**30, 2**20


def init() -> tuple[int, torch.device]:
    device = dist_setup.init()
    return dist.get_rank(), device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mixed_model(device: torch.device, value_seed: int) -> tuple[list[str], list[torch.Tensor]]:
    """The zoo (every dtype, views, ties, tensors split across buckets) plus a few layer-sized
    tensors that go in place: both paths of the pipeline in every sync."""
    on_gpu = device.type == "cuda"
    zoo = make_zoo(11, device, (1 * MiB) if on_gpu else (64 << 10), value_seed)
    g = torch.Generator().manual_seed(value_seed)
    for i in range(4 if on_gpu else 2):
        t = torch.empty((8 * MiB if on_gpu else 1 * MiB) // 2 + 8 * i, dtype=torch.bfloat16, device=device)
        fill_random_bytes(t, g)
        zoo.append((f"layer{i}.weight", t))
    return [n for n, _ in zoo], [t for _, t in zoo]


def poison(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes into any tensor, views included (bools stay 0/1)."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    if t.dtype == torch.bool:
        raw &= 1
    t.copy_(raw.to(t.device).view(t.dtype).view(t.shape))  # same dtype: a bitwise copy


def emit(rows: list[dict], out: str | None) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as f:
            f.write(text)
    sys.stdout.write(text)
    sys.stdout.flush()


def gather_rows(row: dict, size: int = 4096) -> list[dict]:
    """Every rank's row, through fixed-size 4 KiB records. Not all_gather_object: under compute-sanitizer
    memcheck, NCCL's LL all-gather of its odd-sized (49-byte) pickle reads past the buffer's end."""
    blob = json.dumps(row).encode()
    assert len(blob) < size, f"row too long for the record: {len(blob)} bytes"
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rec = torch.zeros(size, dtype=torch.uint8)
    rec[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, rec.to(device))
    return [json.loads(bytes(o.cpu().tolist()).rstrip(b"\0")) for o in out]


# ---------------------------------------------------------------------------------------------------
# soak: N consecutive syncs; memory after each against the state after the first.

def mode_soak(args) -> bool:
    rank, device = init()
    src = 0
    names, tensors = mixed_model(device, 100 if rank == src else 200 + rank)
    _, reference = mixed_model(device, 100)
    expected = tensor_hashes(reference).cpu()
    del reference
    on_gpu = device.type == "cuda"
    iters = args.iters or (1000 if on_gpu else 100)
    mem = (lambda: (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))) if on_gpu \
        else (lambda: (0, 0))
    poison_gen = torch.Generator().manual_seed(300 + rank)
    errors, checks, checks_ok = [], 0, 0
    first = last = (0, 0)
    growth = [0, 0]
    peak_over_first = 0
    times = []
    t_start = time.perf_counter()
    for it in range(iters):
        check = it % args.check_every == 0 or it == iters - 1
        if check and rank != src:
            for t in tensors:  # a sync that wrote nothing would now fail the check
                poison(t, poison_gen)
        try:
            sync(device)
            if on_gpu and it > 0:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            coalesced_bcast.broadcast_tensors(tensors, src, names=names, verify=check)
            sync(device)
            times.append(time.perf_counter() - t0)
            if check:
                checks += 1
                ok = torch.equal(tensor_hashes(tensors).cpu(), expected)
                checks_ok += int(ok)
                if not ok:
                    errors.append(f"iteration {it}: hashes differ from the source's values on rank {rank}")
        except Exception as e:  # noqa: BLE001 - recorded; a failed collective leaves the group unusable
            errors.append(f"iteration {it}: {type(e).__name__}: {e}")
            break
        now = mem()
        if it == 0:
            first = now
        else:
            growth = [max(growth[0], now[0] - first[0]), max(growth[1], now[1] - first[1])]
            if on_gpu:
                peak_over_first = max(peak_over_first, torch.cuda.max_memory_allocated(device) - first[0])
        last = now
    seconds = time.perf_counter() - t_start
    row = dict(mode="soak", rank=rank, backend=str(dist.get_backend()), device=str(device), iters=iters,
               tensors=len(tensors), bytes=sum(t.numel() * t.element_size() for t in tensors),
               first_allocated=first[0], first_reserved=first[1], last_allocated=last[0], last_reserved=last[1],
               max_growth_allocated=growth[0], max_growth_reserved=growth[1],
               max_peak_allocated_over_first=peak_over_first, checks=checks, checks_ok=checks_ok,
               errors=errors, seconds=round(seconds, 3),
               median_sync_ms=round(1e3 * statistics.median(times), 3) if times else None)
    rows = gather_rows(row)
    ok = all(not r["errors"] and r["max_growth_allocated"] == 0 and r["max_growth_reserved"] == 0
             and r["checks_ok"] == r["checks"] > 0 for r in rows)
    if rank == 0:
        for r in rows:
            r["ok"] = ok
        emit(rows, args.out)
    dist.destroy_process_group()
    return ok


# ---------------------------------------------------------------------------------------------------
# gpu-checks: the verify hash on the device, its cost, and bad input over NCCL.

def _time(fn, device, reps=5) -> float:
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _count_kernels(fn) -> int | None:
    """CUDA kernels one call launches (the profiler's view), or None if the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower())
    except Exception:  # noqa: BLE001 - a measurement, not a check
        return None


def mode_gpu_checks(args) -> bool:
    rank, device = init()
    on_gpu = device.type == "cuda"
    results = []

    def record(name, ok, **kw):
        results.append(dict(mode="gpu-checks", check=name, rank=rank, ok=bool(ok), **kw))

    # 1. The device hash equals the host hash, bit for bit, for every dtype and layout in the zoo.
    zoo = make_zoo(5, device, 1 * MiB if on_gpu else 64 << 10, value_seed=42)
    tensors = [t for _, t in zoo]
    got = tensor_hashes(tensors).cpu()
    want = tensor_hashes([t.cpu() for t in tensors])
    bad = [zoo[i][0] for i in range(len(zoo)) if got[i] != want[i]]
    record("hash_device_equals_host", not bad and got[-1] == want[-1], mismatched=bad[:10])

    # 2. One flipped bit on one rank after a sync is caught on every rank, naming the tensor.
    names = [n for n, _ in zoo]
    zoo_src = make_zoo(5, device, 1 * MiB if on_gpu else 64 << 10, value_seed=42 if rank == 0 else 7 + rank)
    ts = [t for _, t in zoo_src]
    coalesced_bcast.broadcast_tensors(ts, 0, names=names, verify=True)
    k = names.index("bfloat16.transposed")
    if rank == 1:
        ts[k].view(torch.int16)[1, 2] ^= 1
    try:
        verify_tensors(ts, 0, names=names)
        record("verify_catches_one_bit", False, message="no error")
    except VerifyError as e:
        record("verify_catches_one_bit", "('bfloat16.transposed')" in str(e) and "rank(s) [1]" in str(e),
               message=str(e)[:300])

    # 3. Cost of the check: hashing alone and the whole verify (hash + one all_reduce).
    from shapes import llama8b_shapes, small_shapes
    states = {"small16k": small_shapes(16384 if on_gpu else 512)}
    if on_gpu:
        states["llama8b"] = llama8b_shapes()
    for name, shapes in states.items():
        torch.manual_seed(1234)  # the same values on every rank, as after a sync
        state = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
        for t in state:
            t.view(torch.int16).random_(-2**15, 2**15 - 1)
        nbytes = sum(t.numel() * t.element_size() for t in state)
        hash_s = _time(lambda: tensor_hashes(state), device)
        verify_s = _time(lambda: verify_tensors(state, 0), device)
        record(f"verify_cost_{name}", True, tensors=len(state), bytes=nbytes, hash_ms=round(hash_s * 1e3, 3),
               verify_ms=round(verify_s * 1e3, 3), hash_GBps=round(nbytes / hash_s / 1e9, 1),
               kernels_per_hash=_count_kernels(lambda: tensor_hashes(state)) if on_gpu else None)
        # The device kernel against the host loop on real shapes (a slice of the big state: host time).
        part = state if name == "small16k" else state[1:9]
        same = torch.equal(tensor_hashes(part).cpu(), tensor_hashes([t.cpu() for t in part]))
        record(f"hash_device_equals_host_{name}", same, tensors=len(part))
        state = part = None  # free before the next state
        if on_gpu:
            torch.cuda.empty_cache()

    # 4. Wrong device over NCCL: rank 1 passes CPU tensors to a group with no CPU backend, then a list
    #    mixing cpu and cuda; every rank must raise the same AgreementError, nothing written.
    if on_gpu:
        for case in ("cpu_on_nccl", "mixed_devices"):
            x = [torch.full((100,), float(rank), device=device), torch.full((10,), float(rank), device=device)]
            if rank == 1:
                x = [t.cpu() for t in x] if case == "cpu_on_nccl" else [x[0], x[1].cpu()]
            before = [t.clone() for t in x]
            t0 = time.perf_counter()
            try:
                coalesced_bcast.broadcast_tensors(x, 0)
                msg = "no error"
            except AgreementError as e:
                msg = str(e)
            msgs = [None] * dist.get_world_size()
            dist.all_gather_object(msgs, msg)
            untouched = all(torch.equal(a, b) for a, b in zip(before, x))
            record(f"refused_{case}", msg != "no error" and len(set(msgs)) == 1 and untouched
                   and time.perf_counter() - t0 < 10, message=msg[:300])

    rows = [r for rs in gather_rows(results) for r in rs]
    ok = all(r["ok"] for r in rows)
    if rank == 0:
        emit(rows, args.out)
    dist.destroy_process_group()
    return ok


# ---------------------------------------------------------------------------------------------------
# sanitize: a small full sync (buckets, strided views, ties, in place, verify) for compute-sanitizer.

def mode_sanitize(args) -> bool:
    rank, device = init()
    ok = True
    for src in range(dist.get_world_size()):
        zoo = make_zoo(3, device, 64 << 10, value_seed=10 + src if rank == src else 50 + rank)
        want = make_zoo(3, device, 64 << 10, value_seed=10 + src)
        names = [n for n, _ in zoo]
        coalesced_bcast.broadcast_tensors([t for _, t in zoo], src, names=names, bucket_bytes=16 << 10,
                                          ring_depth=2, inplace_min_bytes=32 << 10, verify=True)
        sync(device)
        wrong = [n for (n, a), (_, b) in zip(zoo, want) if not same_bits(a, b)]
        ok &= not wrong
        if wrong:
            print(f"rank {rank} src {src}: wrong {wrong}", flush=True)
        # An FSDP unit: parameters back to back in one buffer (one broadcast for the run), two small
        # norms in place too (no ring, the caller's stream), and on rank 1 one tensor in its own
        # allocation, so that the ranks agree on splitting the run there.
        for split in (False, True):
            g = torch.Generator().manual_seed(100 + src)
            sizes = [(64, 256), (32, 256), (256,), (48, 256), (256,)]
            want = [torch.randn(sz, generator=g).to(device) for sz in sizes]
            buf = torch.full((sum(math.prod(sz) for sz in sizes),), float(rank), device=device)
            unit, offset = [], 0
            for sz in sizes:
                unit.append(buf[offset:offset + math.prod(sz)].view(sz))
                offset += math.prod(sz)
            if split and rank == 1:
                unit[3] = torch.full(sizes[3], -1.0, device=device)
            if rank == src:
                for t, w in zip(unit, want):
                    t.copy_(w)
            stats = coalesced_bcast.broadcast_tensors(unit, src, inplace_min_bytes=32 << 10, verify=True)
            sync(device)
            wrong = [i for i, (a, b) in enumerate(zip(unit, want)) if not same_bits(a, b)]
            expect_ops = 3 if split else 1
            ok &= not wrong and stats.buckets == 0 and stats.inplace_ops == expect_ops
            if wrong or stats.buckets or stats.inplace_ops != expect_ops:
                print(f"rank {rank} src {src} unit split={split}: wrong {wrong}, {stats}", flush=True)
    rows = gather_rows(dict(mode="sanitize", rank=rank, ok=ok))
    ok = all(r["ok"] for r in rows)
    if rank == 0:
        emit(rows, args.out)
    dist.destroy_process_group()
    return ok


# ---------------------------------------------------------------------------------------------------
# timeout: each case in a fresh pair of processes; the parent watches the survivor (rank 0).

CASES = {
    # rank 1 never calls; rank 0 passes timeout=T (the group's own timeout is much longer)
    "never_calls": dict(group_timeout=600, arg_timeout=True),
    # rank 1 dies before calling
    "died_before_call": dict(group_timeout=600, arg_timeout=True),
    # rank 1 never calls; no timeout argument, the group was created with T
    "group_timeout": dict(group_timeout=None, arg_timeout=False),
    # rank 1 (the source) agrees, then stalls; rank 0 waits in the payload broadcast
    "stuck_after_agreement": dict(group_timeout=600, arg_timeout=True),
}


def _timeout_child(rank: int, case: str, store_path: str, work: str, t: float) -> None:
    fd = os.open(os.path.join(work, f"{case}.{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    spec = CASES[case]
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    store = dist.FileStore(store_path, 2)
    group_t = timedelta(seconds=spec["group_timeout"] or t)
    if gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=group_t, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=group_t)
    x = [torch.full((1000,), float(rank), device=device), torch.full((1 << 20,), float(rank), device=device)]
    # Warm: communicators exist and NCCL has connected what the cases use (it connects lazily, and a
    # first broadcast of a kind blocks the host until the peer joins it: no deadline of ours applies).
    coalesced_bcast.broadcast_tensors(x, 0, bucket_bytes=1 << 16)
    for src in (0, 1):
        coalesced_bcast.broadcast_tensors(x, src, bucket_bytes=1 << 16, inplace_min_bytes=1 << 40, small_inplace_max=0)
    sync(device)
    dist.barrier()
    kw = dict(timeout=t) if spec["arg_timeout"] else {}
    if rank == 1:
        if case == "died_before_call":
            os._exit(0)
        if case == "stuck_after_agreement":
            from coalesced_bcast import _C
            from coalesced_bcast.agree import check_agreement
            plan = _C.Plan(x, [], 1 << 16, 2, 1 << 40, 0, rank)
            check_agreement(plan, None, dist.group.WORLD, 1, [])
        time.sleep(t + 120)
        os._exit(0)
    with open(os.path.join(work, f"{case}.start"), "w") as f:
        f.write(str(time.time()))
    try:
        coalesced_bcast.broadcast_tensors(x, 1 if case == "stuck_after_agreement" else 0, bucket_bytes=1 << 16, **kw)
        sync(device)
        outcome = "returned without error"
    except Exception as e:  # noqa: BLE001 - what it was is the result
        outcome = f"raised {type(e).__name__}: {e}"
    with open(os.path.join(work, f"{case}.result"), "w") as f:
        json.dump({"time": time.time(), "outcome": outcome}, f)
    os._exit(0)


def mode_timeout(args) -> bool:
    import torch.multiprocessing as mp
    t = args.timeout_s
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in args.cases.split(",") if args.cases else CASES:
            ctx = mp.start_processes(_timeout_child, args=(case, os.path.join(work, f"{case}.store"), work, t),
                                     nprocs=2, join=False, start_method="spawn")
            p0 = ctx.processes[0]
            start_file = os.path.join(work, f"{case}.start")
            deadline = time.time() + 180  # init included
            while not os.path.exists(start_file) and p0.is_alive() and time.time() < deadline:
                time.sleep(0.1)
            started = float(open(start_file).read()) if os.path.exists(start_file) else None
            hard = (started or time.time()) + t + args.slack_s + 60
            while p0.is_alive() and time.time() < hard:
                time.sleep(0.1)
            ended = time.time()
            hung = p0.is_alive()
            result_file = os.path.join(work, f"{case}.result")
            result = json.load(open(result_file)) if os.path.exists(result_file) else None
            if result:
                ended = result["time"]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(10)
            log = open(os.path.join(work, f"{case}.0.log"), errors="replace").read()
            elapsed = ended - started if started else None
            outcome = result["outcome"] if result else (
                "hung: killed by the check" if hung else f"process ended, exit code {p0.exitcode}")
            ok = (started is not None and not hung and elapsed is not None and elapsed <= t + args.slack_s
                  and not outcome.startswith("returned"))
            rows.append(dict(mode="timeout", case=case, backend="nccl" if torch.cuda.device_count() >= 2 else "gloo",
                             timeout_s=t, seconds_to_stop=round(elapsed, 2) if elapsed else None, outcome=outcome[:600],
                             survivor_exitcode=p0.exitcode,
                             log_tail=[ln for ln in log.splitlines() if ln.strip()][-6:], ok=ok,
                             env={k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                                 "TORCH_NCCL_BLOCKING_WAIT")}))
            emit(rows[-1:], args.out)
    return all(r["ok"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="soak", choices=["soak", "gpu-checks", "timeout", "sanitize"])
    ap.add_argument("--out", default=None, help="JSON lines file to append to (default: $OUT/soak-MODE.jsonl)")
    ap.add_argument("--iters", type=int, default=0, help="soak: syncs (default 1000 on GPU, 100 on CPU)")
    ap.add_argument("--check-every", type=int, default=100, help="soak: poison + verify + bitwise every N")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="timeout: the deadline under test")
    ap.add_argument("--slack-s", type=float, default=30.0, help="timeout: allowed beyond the deadline")
    ap.add_argument("--cases", default="", help="timeout: comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args()
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], f"soak-{args.mode}.jsonl")
    fn = {"soak": mode_soak, "gpu-checks": mode_gpu_checks, "timeout": mode_timeout, "sanitize": mode_sanitize}
    try:
        ok = fn[args.mode](args)
    except Exception:
        traceback.print_exc()
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

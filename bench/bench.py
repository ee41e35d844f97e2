"""Every way to broadcast a model's state, side by side, in one run.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench.py [--cases ...] [--out DIR]

On GPUs (NCCL) it measures the real cases; on CPU (gloo) a scaled-down version of the same cases.
Per case, every method runs on the same tensors: warm-up (also the memory measurement, after
empty_cache and reset_peak_memory_stats), receivers poisoned, `--reps` timed repetitions (median),
then a bitwise check of every tensor on every rank against the source's seeded values.
Writes DIR/bench.json (rows), DIR/bench.md (table) and DIR/bench.png (plot, if matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import coalesced_bcast  # noqa: E402
from coalesced_bcast.bits import as_int  # noqa: E402
from shapes import llama8b_shapes, small_shapes  # noqa: E402

import dist_setup  # noqa: E402  (beside this script)

GiB, MiB = 2**30, 2**20


# ---------------------------------------------------------------------------------------------------
# States: (name, dtype, shape, view) entries; view "t" makes a transposed (non-contiguous) parameter.

def llama_layers_bytes(layers: int) -> list:
    """Llama-8B blocks without the vocabulary: about 0.43 GiB each (the scaling series)."""
    shapes = llama8b_shapes(layers=layers)[1:-2]
    return [(f"w{i}", torch.bfloat16, s, None) for i, s in enumerate(shapes)]


def mixed_state(layers: int, hidden: int, fp8: torch.dtype = torch.float8_e4m3fn) -> list:
    """Several dtypes, buffers, a tied pair, non-contiguous views, many small tensors."""
    out = [("embed", torch.bfloat16, (8 * hidden, hidden), None)]
    for i in range(layers):
        out += [(f"l{i}.qkv", torch.bfloat16, (3 * hidden, hidden), None),
                (f"l{i}.o.t", torch.bfloat16, (hidden, hidden), "t"),
                (f"l{i}.mlp", fp8, (4 * hidden, hidden), None),
                (f"l{i}.norm", torch.float32, (hidden,), None),
                (f"l{i}.bias", torch.float16, (hidden,), None),
                (f"l{i}.step", torch.int64, (), None),
                (f"l{i}.mask", torch.bool, (hidden // 4,), None),
                (f"l{i}.rope", torch.complex64, (hidden // 8, 64), None)]
        out += [(f"l{i}.lora{j}", torch.float32, (16, 64 + j), None) for j in range(64)]
    out.append(("head", "tied:embed", None, None))
    return out


def moe_state(layers: int, hidden: int, inter: int, experts: int, vocab: int) -> list:
    """A Mixture-of-Experts decoder in the Hugging Face layout: every expert's matrices separate, fp32
    routers and norms among the bf16 weights."""
    out = [("embed", torch.bfloat16, (vocab, hidden), None)]
    for i in range(layers):
        out += [(f"l{i}.{n}", torch.bfloat16, (hidden, hidden), None) for n in ("q", "k", "v", "o")]
        out += [(f"l{i}.router", torch.float32, (experts, hidden), None),
                (f"l{i}.n1", torch.float32, (hidden,), None), (f"l{i}.n2", torch.float32, (hidden,), None)]
        for e in range(experts):
            out += [(f"l{i}.e{e}.w1", torch.bfloat16, (inter, hidden), None),
                    (f"l{i}.e{e}.w2", torch.bfloat16, (hidden, inter), None),
                    (f"l{i}.e{e}.w3", torch.bfloat16, (inter, hidden), None)]
    return out + [("norm", torch.float32, (hidden,), None), ("head", torch.bfloat16, (vocab, hidden), None)]


def moe_hf_state(layers: int, hidden: int, inter: int, experts: int) -> list:
    """A Mixture-of-Experts decoder shaped as Hugging Face builds Qwen3-MoE (a module per expert matrix:
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight), small matrices: ~3 tensors per expert, ~19k tensors
    in ~40k modules at 48 layers of 128 experts. Synced as a module (module_of), where walking the tree is
    part of a one-shot sync's host cost."""
    out = []
    for i in range(layers):
        at = f"model.layers.{i}"
        out += [(f"{at}.self_attn.{n}_proj.weight", torch.bfloat16, (hidden, hidden), None) for n in "qkvo"]
        out += [(f"{at}.input_layernorm.weight", torch.bfloat16, (hidden,), None),
                (f"{at}.post_attention_layernorm.weight", torch.bfloat16, (hidden,), None),
                (f"{at}.mlp.gate.weight", torch.bfloat16, (experts, hidden), None)]
        for e in range(experts):
            out += [(f"{at}.mlp.experts.{e}.{n}.weight", torch.bfloat16, shape, None)
                    for n, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                     ("down_proj", (hidden, inter)))]
    return out + [("model.norm.weight", torch.bfloat16, (hidden,), None)]


def module_of(spec: list, tensors: list) -> nn.Module:
    """The tensors as a module tree by their dotted names (parameters share the tensors' storage)."""
    root = nn.Module()
    for (name, *_), t in zip(spec, tensors):
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


def cnn_state(blocks: int, width: int) -> list:
    """A CNN in channels_last (non-contiguous 4-D weights) with batch norms: weight, bias, two running
    statistics and an int64 counter per norm."""
    out = []
    for i in range(blocks):
        c = width * (1 + i % 4)
        out += [(f"b{i}.conv", torch.float32, (c, c, 3, 3), "cl"), (f"b{i}.bn.w", torch.float32, (c,), None),
                (f"b{i}.bn.b", torch.float32, (c,), None), (f"b{i}.bn.mean", torch.float32, (c,), None),
                (f"b{i}.bn.var", torch.float32, (c,), None), (f"b{i}.bn.n", torch.int64, (), None)]
    return out + [("fc", torch.float32, (1000, 4 * width), None)]


def cases(on_gpu: bool) -> dict:
    if on_gpu:
        return {
            "llama8b": [(f"w{i}", torch.bfloat16, s, None) for i, s in enumerate(llama8b_shapes())],
            "small16k": [(f"s{i}", torch.bfloat16, s, None) for i, s in enumerate(small_shapes())],
            "mixed": mixed_state(layers=16, hidden=4096),
            "moe": moe_state(layers=16, hidden=2048, inter=1408, experts=32, vocab=32000),
            "cnn": cnn_state(blocks=36, width=128),
            "moe_hf": moe_hf_state(layers=48, hidden=512, inter=128, experts=128),
            "scale1G": llama_layers_bytes(2),
            "scale4G": llama_layers_bytes(9),
            "scale15G": llama_layers_bytes(35),
            "scale60G": llama_layers_bytes(141),
        }
    return {  # gloo on CPU: the same shapes of cases, scaled to a 2-core machine
        "llama8b": [(f"w{i}", torch.bfloat16, s, None) for i, s in
                    enumerate(llama8b_shapes(layers=2, hidden=256, inter=896, kv=64, vocab=8000))],
        "small16k": [(f"s{i}", torch.bfloat16, s, None) for i, s in enumerate(small_shapes(n=2000))],
        "mixed": mixed_state(layers=2, hidden=128, fp8=torch.int8),  # gloo has no float8
        "moe": moe_state(layers=2, hidden=64, inter=48, experts=8, vocab=500),
        "cnn": cnn_state(blocks=8, width=16),
        "moe_hf": moe_hf_state(layers=4, hidden=32, inter=16, experts=32),
        "scale1G": [(f"w{i}", torch.bfloat16, s, None) for i, s in
                    enumerate(llama8b_shapes(layers=1, hidden=256, inter=896, kv=64, vocab=8)[1:-2])],
        "scale4G": [(f"w{i}", torch.bfloat16, s, None) for i, s in
                    enumerate(llama8b_shapes(layers=4, hidden=256, inter=896, kv=64, vocab=8)[1:-2])],
    }


def build(spec: list, device: torch.device) -> list[torch.Tensor]:
    made, out = {}, []
    for name, dtype, shape, view in spec:
        if isinstance(dtype, str):  # a tie: the same tensor object again
            out.append(made[dtype.split(":")[1]])
            continue
        if view == "cl":
            t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
        else:
            t = torch.empty(shape if view != "t" else tuple(reversed(shape)), dtype=dtype, device=device)
            t = t.t() if view == "t" else t
        made[name] = t
        out.append(t)
    return out


def _draw(t: torch.Tensor, g: torch.Generator) -> None:
    as_int(t).random_(0, 2, generator=g) if t.dtype == torch.bool else as_int(t).random_(generator=g)


def fill(tensors: list[torch.Tensor], seed: int, poison: bool) -> None:
    """Source values from a seeded generator (every rank can regenerate them); poison: all-ones bits."""
    g = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in {id(t): t for t in tensors}.values():  # a tied tensor gets one draw
        if poison:
            as_int(t).fill_(-1 if t.element_size() > 1 else 1)
        else:
            _draw(t, g)


def check(tensors: list[torch.Tensor], seed: int) -> bool:
    """Regenerates the source's values one tensor at a time (no second copy of the state)."""
    g = torch.Generator(device=tensors[0].device).manual_seed(seed)
    ok = True
    for t in {id(t): t for t in tensors}.values():
        expected = torch.empty_like(t)
        _draw(expected, g)
        ok &= torch.equal(as_int(t), as_int(expected))
    return bool(ok)


def per_tensor(tensors):
    """One dist.broadcast per tensor (DeepSpeed, Horovod, DCP): a contiguous copy where needed."""
    for t in tensors:
        if t.is_contiguous():
            dist.broadcast(t, 0)
        else:
            c = t.contiguous()
            dist.broadcast(c, 0)
            t.copy_(c)


# ---------------------------------------------------------------------------------------------------
# Methods

_legacy_stream = None


def legacy_record_stream(tensors, bucket=250 * MiB):
    """torch <= 2.7 inside comm.cpp + ProcessGroupNCCL: a flat copy per bucket made on the current
    stream, broadcast on another stream, record_stream'ed onto it, unflattened back."""
    global _legacy_stream
    _legacy_stream = _legacy_stream or torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    groups, g, size = [], [], 0
    for t in tensors:
        g.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket:
            groups.append(g)
            g, size = [], 0
    if g:
        groups.append(g)
    for g in groups:
        by_dtype = {}
        for t in g:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(ts)
            _legacy_stream.wait_stream(cur)
            with torch.cuda.stream(_legacy_stream):
                dist.broadcast(flat, 0)
            flat.record_stream(_legacy_stream)
            cur.wait_stream(_legacy_stream)
            if dist.get_rank() != 0:
                for t, o in zip(ts, torch._utils._unflatten_dense_tensors(flat, ts)):
                    t.copy_(o, non_blocking=True)
            del flat


def kept_plan(**options):
    """Ours with a kept plan: planned (and agreed) on the first call, which is the memory window; the
    timed repetitions each cost the plan's check, one small agreement and the transfer."""
    state = {}

    def run(ts):
        if "plan" not in state:
            state["plan"] = coalesced_bcast.plan_sync(ts, 0, **options)
        return state["plan"].run()
    return run


def module_sync(spec: list):
    """sync_module of the tensors as a module tree (module_of, built on the first call)."""
    state = {}

    def run(ts):
        if state.get("tensors") is not ts:
            state.update(tensors=ts, module=module_of(spec, ts))
        return coalesced_bcast.sync_module(state["module"], 0)
    return run


def methods(on_gpu: bool, case: str, spec: list) -> dict:
    ours = lambda **kw: (lambda ts: coalesced_bcast.broadcast_tensors(ts, 0, **kw))  # noqa: E731
    m = {
        "broadcast_coalesced": lambda ts: dist._broadcast_coalesced(dist.group.WORLD, ts, 250 * MiB, 0),
        "per_tensor": per_tensor,
        "coalesced_bcast": ours(),
        "coalesced_bcast[kept plan]": kept_plan(),
        # the first buckets sent while the ranks agree (plan_sync(speculate=True)); the ring kept between runs
        "coalesced_bcast[kept plan, speculate]": kept_plan(speculate=True),
    }
    if on_gpu:
        m["legacy_record_stream"] = legacy_record_stream
    if case.startswith("scale"):
        m.pop("per_tensor")
        m.pop("legacy_record_stream", None)
        return m
    if case == "moe_hf":
        m["coalesced_bcast[sync_module]"] = module_sync(spec)
    if case in ("moe", "cnn", "moe_hf"):
        return m
    for b in (16, 32, 64):
        m[f"coalesced_bcast[bucket={b}M]"] = ours(bucket_bytes=b * MiB)
    m["coalesced_bcast[kept plan, bucket=64M]"] = kept_plan(bucket_bytes=64 * MiB)
    for d in (3, 4):
        m[f"coalesced_bcast[depth={d}]"] = ours(ring_depth=d)
    m["coalesced_bcast[inplace=off]"] = ours(inplace_min_bytes=1 << 50)
    m["coalesced_bcast[coalesce=off]"] = ours(coalesce_bytes=0)
    m["coalesced_bcast[coalesce=256M]"] = ours(coalesce_bytes=256 * MiB)
    m["coalesced_bcast[coalesce=all]"] = ours(coalesce_bytes=1 << 50)
    m["coalesced_bcast[inplace=64M]"] = ours(inplace_min_bytes=64 * MiB)
    return m


# ---------------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, tensors, device, reps):
    """(median seconds, peak extra allocated, peak extra reserved, first-call seconds)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base_a, base_r = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    fn(tensors)
    sync(device)
    first = time.perf_counter() - t0
    extra_a = torch.cuda.max_memory_allocated() - base_a if cuda else 0
    extra_r = torch.cuda.max_memory_reserved() - base_r if cuda else 0
    if dist.get_rank() != 0 and tensors is not None:
        fill(tensors, 0, poison=True)
    times, results = [], []
    for _ in range(reps):
        sync(device)
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        results.append(fn(tensors))
        sync(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return median, extra_a, extra_r, first, results[times.index(median)] if median in times else results[-1]


def ceiling(nbytes, device, reps, piece=None):
    """One flat broadcast of nbytes; with `piece`, the same bytes as back-to-back broadcasts of that
    size from one buffer (the link at a bucket's size, with no copy, event or ring around it)."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if piece is None:
        fn = lambda _: dist.broadcast(flat, 0)  # noqa: E731
    else:
        parts = flat.split(piece)
        fn = lambda _: [dist.broadcast(p, 0) for p in parts]  # noqa: E731
    fn(None)
    sec, a, r, _, _ = measure(fn, None, device, reps)
    del flat
    return sec, a, r


def table_line(r):
    host = "-"
    if "plan_us_per_tensor" in r:  # ours: host microseconds per tensor, plan / agree / enqueue
        host = f"{r['plan_us_per_tensor']:.3f}/{r['agree_us_per_tensor']:.3f}/{r['enqueue_us_per_tensor']:.3f}"
    return (f"{r['case']:>9} {r['method']:>32} {r['bytes']:>13} {r['tensors']:>6} {r['rank']:>4} "
            f"{r['seconds'] * 1e6:>11.1f} {r['gbps']:>7.1f} {r['gbps']:>7.1f} {r['pct_of_ceiling']:>6.1f} "
            f"{r['peak_extra_allocated_bytes'] / MiB:>9.1f} {r['peak_extra_reserved_bytes'] / MiB:>9.1f} "
            f"{'-' if r['correct'] is None else int(not r['correct']):>6} {host:>20}")


HEADER = (f"{'case':>9} {'method':>32} {'size(B)':>13} {'count':>6} {'rank':>4} {'time(us)':>11} "
          f"{'algbw':>7} {'busbw':>7} {'%ceil':>6} {'xalloc':>9} {'xresv':>9} {'#wrong':>6} {'host us/tensor':>20}\n"
          f"{'':>9} {'':>32} {'':>13} {'':>6} {'':>4} {'':>11} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} "
          f"{'(MiB)':>9} {'(MiB)':>9} {'':>6} {'plan/agree/enqueue':>20}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated subset of cases (default: all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="results folder (default: bench/results, or bench/results/cpu)")
    args = ap.parse_args()

    device = dist_setup.init()
    on_gpu = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results" if on_gpu else os.path.join("results", "cpu"))
    env = dict(gpu=torch.cuda.get_device_name(device) if on_gpu else "cpu", torch=torch.__version__,
               nccl=".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None)

    selected = [c for c in args.cases.split(",") if c]
    rows = []
    for case, spec in cases(on_gpu).items():
        if selected and case not in selected:
            continue
        tensors = build(spec, device)
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
        del tensors
        c_sec, c_a, c_r = ceiling(nbytes, device, args.reps)
        base = dict(case=case, rank=rank, world_size=world, bytes=nbytes, **env)
        rows.append(dict(base, method="ceiling", tensors=1, seconds=c_sec, gbps=nbytes / c_sec / 1e9,
                         pct_of_ceiling=100.0, peak_extra_allocated_bytes=c_a, peak_extra_reserved_bytes=c_r,
                         correct=None))  # the reference: its bytes are not checked
        if not case.startswith("scale"):  # what the ring's broadcasts could reach at the default bucket size
            piece = coalesced_bcast.DEFAULT_BUCKET_BYTES
            p_sec, p_a, p_r = ceiling(nbytes, device, args.reps, piece)
            rows.append(dict(base, method=f"ceiling[{piece // MiB}M pieces]", tensors=-(-nbytes // piece),
                             seconds=p_sec, gbps=nbytes / p_sec / 1e9, pct_of_ceiling=100.0 * c_sec / p_sec,
                             peak_extra_allocated_bytes=p_a, peak_extra_reserved_bytes=p_r, correct=None))
            if rank == 0:
                print(table_line(rows[-1]), flush=True)
        tensors = build(spec, device)
        for name, fn in methods(on_gpu, case, spec).items():
            fill(tensors, seed=7, poison=rank != 0)
            sec, a, r, first, result = measure(fn, tensors, device, args.reps)
            ok = check(tensors, seed=7)
            rows.append(dict(base, method=name, tensors=len(tensors), seconds=sec, gbps=nbytes / sec / 1e9,
                             pct_of_ceiling=100.0 * c_sec / sec, peak_extra_allocated_bytes=a,
                             peak_extra_reserved_bytes=r, correct=ok, first_seconds=first))
            if isinstance(result, coalesced_bcast.SyncStats):  # where the host time of ours goes
                n = len(tensors)
                rows[-1].update(host_seconds=result.seconds, plan_seconds=result.plan_seconds,
                                agree_seconds=result.agree_seconds, enqueue_seconds=result.enqueue_seconds,
                                plan_us_per_tensor=result.plan_seconds / n * 1e6,
                                agree_us_per_tensor=result.agree_seconds / n * 1e6,
                                enqueue_us_per_tensor=result.enqueue_seconds / n * 1e6,
                                speculated_buckets=result.speculated)
            if rank == 0:
                print(table_line(rows[-1]), flush=True)
        del tensors
        sync(device)

    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        all_rows = [r for rs in gathered for r in rs]
        write_results(all_rows, out)
    dist.destroy_process_group()


#: (case, method, minimum % of the ceiling, maximum extra reserved MiB or None): the targets.
TARGETS = [("small16k", "coalesced_bcast", 50, None), ("small16k", "coalesced_bcast[kept plan]", 80, None),
           ("small16k", "coalesced_bcast[kept plan, speculate]", 80, None),
           ("mixed", "coalesced_bcast", 85, None), ("llama8b", "coalesced_bcast", 97, 64)]


def targets(rows) -> list[str]:
    """Each target against the slowest rank's time (and every rank's memory) of this run."""
    out = []
    for case, method, pct, resv in TARGETS:
        ours = [r for r in rows if r["case"] == case and r["method"] == method]
        ceil = [r for r in rows if r["case"] == case and r["method"] == "ceiling"]
        if not ours or not ceil:
            continue
        got = 100.0 * max(r["seconds"] for r in ceil) / max(r["seconds"] for r in ours)
        worst = max(r["peak_extra_reserved_bytes"] for r in ours) / MiB
        ok = got >= pct and (resv is None or worst <= resv) and all(r["correct"] for r in ours)
        out.append(f"target {case} {method}: {got:.1f}% of the ceiling (slowest rank; need >= {pct}%)"
                   + (f", extra reserved {worst:.1f} MiB (need <= {resv})" if resv is not None else "")
                   + f": {'MET' if ok else 'MISSED'}")
    return out


def write_results(rows, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [HEADER] + [table_line(r) for r in sorted(rows, key=lambda r: (r["case"], r["method"], r["rank"]))]
    r0 = rows[0]
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(f"# coalesced_bcast benchmark\n\n{r0['world_size']} ranks, {r0['gpu']}, torch {r0['torch']}, "
                f"NCCL {r0['nccl']}. GB/s = 1e9 B/s; busbw = algbw for broadcast; xalloc/xresv = peak extra "
                f"allocated/reserved on that rank; #wrong = 1 if any tensor differed from the source.\n\n```\n")
        f.write("\n".join(lines) + "\n```\n")
        f.write("\n" + "\n".join(f"- {t}" for t in targets(rows)) + "\n")
    print("\n".join(lines + targets(rows)), flush=True)
    plot(rows, os.path.join(out, "bench.png"))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    main_methods = ["ceiling", "broadcast_coalesced", "per_tensor", "legacy_record_stream", "coalesced_bcast"]
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    width = 0.8 / len(main_methods)
    for i, m in enumerate(main_methods):
        gb, mem = [], []
        for c in case_names:
            rs = [r for r in rows if r["case"] == c and r["method"] == m]
            gb.append(statistics.mean(r["gbps"] for r in rs) if rs else 0)
            mem.append(max(r["peak_extra_reserved_bytes"] for r in rs) / MiB if rs else 0)
        xs = [j + i * width for j in range(len(case_names))]
        axes[0].bar(xs, gb, width, label=m)
        axes[1].bar(xs, mem, width, label=m)
    for ax, title in zip(axes, ["GB/s (mean over ranks)", "peak extra reserved, MiB (max over ranks, log)"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(case_names))], case_names, rotation=20)
        ax.set_title(title)
    axes[1].set_yscale("symlog")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(main_methods), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

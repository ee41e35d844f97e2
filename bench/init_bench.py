"""FSDP1 and DDP init through coalesced_bcast.install(), next to torch's own, in one run.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/init_bench.py \
        [--modes fsdp1_base,fsdp1_cb,...] [--out FILE] [--small]

Modes (each runnable alone; repeat a name to repeat it):
  fsdp1_base / fsdp1_cb   Llama-8B-shaped model (the model of shared/anchors/baseline_bcast.py), FSDP1
                          with a unit per Block and sync_module_states: rank 0 builds it on the device,
                          the others on meta. base: torch's sync, param_init_fn = to_empty(recurse=False);
                          cb: install() and coalesced_bcast.fsdp.param_init_fn.
  ddp_base / ddp_cb       DDP on the same model; rank 0 random, the others to_empty (every rank holds it).
  hf_tied / hf_untied     transformers LlamaForCausalLM from a small LlamaConfig (tie_word_embeddings
                          true/false): random on rank 0, meta elsewhere; FSDP1 + install() + our param_init_fn.
  hf_tied_to_empty        the same, tied, with a plain to_empty param_init_fn (ties split, pytorch issue
                          143181): install() restores them from the source's names.
Every mode checks every parameter and buffer on every rank bitwise against the source's (a per-tensor
digest of the bits computed on the source before the wrap; FSDP states under summon_full_params).

One JSON line per rank and mode: seconds (the FSDP/DDP constructor), sync_seconds (inside torch's sync
function, whichever is installed), memory in GiB: base (allocated before), peak allocated/reserved
(absolute, and extra over the start), and the same extra inside the sync calls alone (sync_extra_*):
the peak of the whole constructor is the max over the sync windows and the windows between them.
The last line is a summary against the targets (FSDP1_RANK1_PEAK_TARGET, time no slower than torch's), then
the summary as one table. On CPU (gloo) --small runs the same modes, scaled down, without memory figures;
torch's FSDP1 refuses CPU states, so fsdp1_base is skipped there.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import importlib
import io
import json
import os
import pstats
import sys
import time
from datetime import timedelta
from typing import Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import coalesced_bcast  # noqa: E402
from coalesced_bcast import agree  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import Block, Model  # noqa: E402
import dist_setup  # noqa: E402

GiB = 2**30
# An FSDP1 init is short and varies between repetitions: five of each, alternating. The
# first of each mode cuts the run at every sync (a synchronize there) to measure the syncs' own memory;
# that also serializes host and GPU at each unit, so times are the medians of the others (not more: rank
# 0 keeps each finished FSDP1 model until the process ends).
ALL_MODES = ["fsdp1_base", "fsdp1_cb"] * 5 + ["ddp_base", "ddp_cb"] * 3 + ["hf_tied", "hf_untied", "hf_tied_to_empty"]
FSDP_INIT = "torch.distributed.fsdp._init_utils"
DDP_MOD = "torch.nn.parallel.distributed"
# Target (GiB): rank 1's FSDP1 peak allocated, below torch's own sync for the Llama-8B-shaped model.
FSDP1_RANK1_PEAK_TARGET = 10.4


# ------------------------------------------------------------------------------------------ models

FULL = dict(layers=32, hidden=4096, inter=14336, kv=1024, vocab=128256)
SMALL = dict(layers=3, hidden=128, inter=320, kv=32, vocab=1000)
HF_FULL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4)
HF_SMALL = dict(vocab_size=500, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(make: Callable[[], nn.Module], on_meta: bool, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Random init on the source's device (in `dtype` directly: no fp32 copy), or on meta."""
    with default_dtype(dtype), torch.device("meta" if on_meta else device):
        return make()


# ---------------------------------------------------------------------------------------- checking

def digest(t: torch.Tensor) -> tuple[int, int, str, tuple]:
    """A function of the exact bits, position-sensitive: two wrapping int64 sums over 8-byte words."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    if b.numel() % 8:
        b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
    w = b.view(torch.int64)
    idx = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
    return int(w.sum()), int((w * idx).sum()), str(t.dtype), tuple(t.shape)


def named_states(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [(n.replace("_fsdp_wrapped_module.", ""), t) for n, t in out if t is not None]


def digests(module: nn.Module) -> dict[str, tuple]:
    return {n: digest(t) for n, t in named_states(module)}


def share_reference(module: Optional[nn.Module], extra: dict) -> tuple[dict, dict]:
    """The source's digests (and facts such as ties), computed on rank 0 before the wrap, to every rank."""
    box = [(digests(module), extra) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def compare(got: dict, want: dict) -> list[str]:
    bad = sorted(got.keys() ^ want.keys())
    bad += [n for n in want if n in got and got[n] != want[n]]
    return bad


# ------------------------------------------------------------------------------------------- probes

class Probe:
    """Peak memory inside the sync calls alone, and the peak of everything, by cutting the run into windows.

    torch has one peak counter; resetting it at each sync boundary and keeping the max of every window
    gives both the whole run's peak and the peak within sync calls.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.peak_alloc = self.peak_reserved = 0
        self.sync_extra_alloc = self.sync_extra_reserved = 0
        self.sync_peak_alloc = self.sync_peak_reserved = 0  # absolute, the max over the sync windows
        self.sync_seconds = 0.0
        self.calls = 0
        self.timers: dict[str, float] = {}
        self._undo: list = []

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def cut(self) -> tuple[int, int]:
        self._sync()
        if not self.cuda:
            return 0, 0
        pa, pr = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        self.peak_alloc, self.peak_reserved = max(self.peak_alloc, pa), max(self.peak_reserved, pr)
        torch.cuda.reset_peak_memory_stats()
        return pa, pr

    def attach(self, mod_name: str, name: str) -> None:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name)

        def probed(*args, **kwargs):
            self.cut()
            a0 = torch.cuda.memory_allocated() if self.cuda else 0
            r0 = torch.cuda.memory_reserved() if self.cuda else 0
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.sync_seconds += time.perf_counter() - t0
                self.calls += 1
                pa, pr = self.cut()
                self.sync_extra_alloc = max(self.sync_extra_alloc, pa - a0)
                self.sync_extra_reserved = max(self.sync_extra_reserved, pr - r0)
                self.sync_peak_alloc = max(self.sync_peak_alloc, pa)
                self.sync_peak_reserved = max(self.sync_peak_reserved, pr)

        setattr(mod, name, probed)
        self._undo.append((mod, name, fn))

    def time_only(self, mod_name: str, name: str, key: str) -> None:
        """Host seconds spent in the module function mod_name.name, summed, with no synchronize."""
        owner, attr = importlib.import_module(mod_name), name
        fn = getattr(owner, attr)
        self.timers.setdefault(key, 0.0)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.timers[key] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def detach(self) -> None:
        for mod, name, fn in reversed(self._undo):
            setattr(mod, name, fn)
        self._undo.clear()


def gib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x / GiB, 4)


def clean(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------- modes

class Ctx:
    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.small = args.small or not self.cuda
        self.dtype = torch.bfloat16


def _allocator_counts(cuda: bool) -> dict[str, int]:
    if not cuda:
        return {}
    stats = torch.cuda.memory_stats()
    return {"cuda_mallocs": stats.get("segment.all.allocated", 0), "cuda_frees": stats.get("segment.all.freed", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def measure(ctx: Ctx, wrap: Callable[[], nn.Module], probe_site: tuple[str, str], cb: bool,
            windows: bool = True, timers: tuple = (), profile: bool = False) -> tuple[nn.Module, dict]:
    """Run the constructor `wrap` (with install() for cb); timing and memory. `windows`: cut the run at
    every sync (see Probe) for the syncs' own memory and time; `timers`: (module, name, key) whose host
    time is summed without any synchronize."""
    clean(ctx.cuda)
    base = torch.cuda.memory_allocated() if ctx.cuda else None
    base_r = torch.cuda.memory_reserved() if ctx.cuda else None
    probe = Probe(ctx.cuda)
    if cb:
        coalesced_bcast.install()
        coalesced_bcast.patched_calls(clear=True)
    for mod_name, name, key in timers:
        probe.time_only(mod_name, name, key)
    if windows:
        probe.attach(*probe_site)
    gc_pauses: list[float] = []
    gc_start = [0.0]

    def on_gc(phase, info):  # Python's collector stops this rank; a host barrier makes the others wait too
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_start[0])

    # the agreement module's store-op counters, where it keeps them (the row leaves them out otherwise)
    op_seconds, op_counts = getattr(agree, "store_op_seconds", {}), getattr(agree, "store_op_counts", {})
    op_seconds.clear()
    op_counts.clear()
    mallocs0 = _allocator_counts(ctx.cuda)
    try:
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        probe.cut()
        gc.callbacks.append(on_gc)
        profiler = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        with profiler or contextlib.nullcontext():
            wrapped = wrap()
        probe.cut()
        seconds = time.perf_counter() - t0
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        probe.detach()
        calls = coalesced_bcast.patched_calls(clear=True) if cb else []
        if cb:
            coalesced_bcast.uninstall()
    if profiler is not None:  # where the host time goes, by function (own time, then with callees)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(ctx.args.profile_dir, f"profile_{'cb' if cb else 'base'}_rank{ctx.rank}.txt"), "w") as f:
            f.write(text.getvalue())
    row = dict(seconds=round(seconds, 4), windows=windows, cb_calls=len(calls), gc_collections=len(gc_pauses),
               gc_ms=round(sum(gc_pauses) * 1e3, 2), gc_max_ms=round(max(gc_pauses, default=0) * 1e3, 2),
               ring_MiB=round(max((c.stats.ring_bytes for c in calls), default=0) / 2**20, 2))
    if windows:
        row.update(sync_seconds=round(probe.sync_seconds, 4), sync_calls=probe.calls)
    row.update({f"{k}_seconds": round(v, 4) for k, v in probe.timers.items()})
    if calls:  # where our syncs' host time went, summed over the calls (the agreement includes waiting for peers)
        for part in ("plan", "agree", "agree_wait", "enqueue"):
            row[f"cb_{part}_seconds"] = round(sum(getattr(c.stats, f"{part}_seconds") for c in calls), 4)
        # broadcasts issued, and tensors sent through buckets because another rank could not send them in place
        row["cb_store_ops"] = {k: [op_counts.get(k, 0), round(v * 1e3, 2)]  # calls, ms
                               for k, v in op_seconds.items()}
        # per sync, ms this rank waited in the agreement for the others: who arrives last, unit by unit
        row["cb_agree_wait_ms"] = [round(c.stats.agree_wait_seconds * 1e3, 2) for c in calls]
        row.update(cb_inplace_ops=sum(c.stats.inplace_ops for c in calls),
                   cb_buckets=sum(c.stats.buckets for c in calls), cb_rerouted=sum(c.stats.rerouted for c in calls))
    if ctx.cuda:
        # segments the caching allocator asked CUDA for (cudaMalloc) and gave back during the run
        row.update({k: v - mallocs0[k] for k, v in _allocator_counts(ctx.cuda).items()})
        row.update(base_alloc_GiB=gib(base), peak_alloc_GiB=gib(probe.peak_alloc),
                   peak_reserved_GiB=gib(probe.peak_reserved), extra_alloc_GiB=gib(probe.peak_alloc - base),
                   extra_reserved_GiB=gib(probe.peak_reserved - base_r),
                   final_alloc_GiB=gib(torch.cuda.memory_allocated()))
        if windows:
            row.update(sync_extra_alloc_GiB=gib(probe.sync_extra_alloc),
                       sync_extra_reserved_GiB=gib(probe.sync_extra_reserved),
                       sync_peak_alloc_GiB=gib(probe.sync_peak_alloc),
                       sync_peak_reserved_GiB=gib(probe.sync_peak_reserved))
    return wrapped, row


# FSDP1's phases per unit: materializing (param_init_fn), the sync (torch's, or ours through install();
# on the rank that arrives first it includes waiting for the others), flattening and sharding.
FSDP_TIMERS = ((FSDP_INIT, "_materialize_with_param_init_fn", "init_fn"),
               (FSDP_INIT, "_sync_module_params_and_buffers", "unit_sync"),
               (FSDP_INIT, "_init_param_handle_from_params", "flatten_shard"),
               ("coalesced_bcast.fsdp", "lay_out_unit", "lay_out"))


def fsdp_mode(ctx: Ctx, make: Callable[[], nn.Module], unit_types: set, cb: bool, plain_to_empty: bool,
              tie_names: Optional[tuple[str, str]] = None, windows: bool = True, profile: bool = False) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    model = build(make, on_meta=ctx.rank != 0, device=ctx.device, dtype=ctx.dtype)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def tied(m: nn.Module) -> Optional[bool]:
        if tie_names is None:
            return None
        # getattr, not get_parameter: under summon_full_params FSDP may expose plain tensors
        a, b = (functools.reduce(getattr, n.split("."), m) for n in tie_names)
        return a.data_ptr() == b.data_ptr()

    want, facts = share_reference(model if ctx.rank == 0 else None, {"tied": tied(model) if ctx.rank == 0 else None})
    in_place0 = coalesced_bcast.fsdp.arena_counts()["flattened_in_place"]
    if plain_to_empty:
        init_fn = lambda m: m.to_empty(device=ctx.device, recurse=False)  # noqa: E731
    else:
        init_fn = coalesced_bcast.fsdp.param_init_fn(ctx.device)
    fsdp, row = measure(ctx, lambda: FSDP(model, auto_wrap_policy=ModuleWrapPolicy(unit_types),
                                          device_id=ctx.device, sync_module_states=True,
                                          param_init_fn=init_fn if ctx.rank else None),
                        (FSDP_INIT, "_sync_module_params_and_buffers"), cb, windows, FSDP_TIMERS, profile)
    row["units"] = len(FSDP.fsdp_modules(fsdp))
    if cb:
        row["units_flattened_in_place"] = coalesced_bcast.fsdp.arena_counts()["flattened_in_place"] - in_place0
    with FSDP.summon_full_params(fsdp, writeback=False):
        got = digests(fsdp)
        row["tied"] = tied(fsdp.module)
    bad = compare(got, want)
    row.update(state_GiB=round(state_bytes / GiB, 4), tensors=len(want), mismatches=bad[:8],
               correct=not bad and row["tied"] == facts["tied"] and (not cb or row["cb_calls"] == row["units"]))
    del fsdp, model
    return row


def ddp_mode(ctx: Ctx, make: Callable[[], nn.Module], cb: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build(make, on_meta=ctx.rank != 0, device=ctx.device, dtype=ctx.dtype)
    if ctx.rank:
        model.to_empty(device=ctx.device)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    want, _ = share_reference(model if ctx.rank == 0 else None, {})
    ddp, row = measure(ctx, lambda: DDP(model, device_ids=[ctx.device.index] if ctx.cuda else None),
                       (DDP_MOD, "_sync_module_states"), cb)
    bad = compare(digests(ddp.module), want)
    row.update(state_GiB=round(state_bytes / GiB, 4), tensors=len(want), mismatches=bad[:8],
               correct=not bad and (not cb or row["cb_calls"] == 1))
    del ddp, model
    return row


def hf_make(ctx: Ctx, tie: bool) -> tuple[Callable[[], nn.Module], set]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(**(HF_SMALL if ctx.small else HF_FULL), tie_word_embeddings=tie)
    return (lambda: LlamaForCausalLM(cfg)), {LlamaDecoderLayer}


def run_mode(ctx: Ctx, mode: str, rep: int = 1) -> dict:
    dims = SMALL if ctx.small else FULL
    make = lambda: Model(**dims)  # noqa: E731
    if mode in ("fsdp1_base", "fsdp1_cb", "fsdp1_base_profile", "fsdp1_cb_profile", "fsdp1_cb_nolayout"):
        if mode.startswith("fsdp1_base") and not ctx.cuda:
            return {"skipped": "torch's FSDP1 refuses CPU states with sync_module_states"}
        profile = mode.endswith("_profile")  # under cProfile: slower, so not among the timed reps
        # nolayout: the source keeps its parameters where they are (a broadcast per parameter; FSDP1
        # copies to flatten), to compare with laying each unit out in one buffer first
        with mock.patch.object(coalesced_bcast.fsdp, "lay_out_unit", lambda *a: False) if "nolayout" in mode \
                else contextlib.nullcontext():
            return fsdp_mode(ctx, make, {Block}, cb="_cb" in mode, plain_to_empty="_base" in mode,
                             windows=rep == 1 and not profile, profile=profile)
    if mode in ("ddp_base", "ddp_cb"):
        return ddp_mode(ctx, make, cb=mode.endswith("_cb"))
    if mode in ("hf_tied", "hf_untied", "hf_tied_to_empty"):
        try:
            tie = mode != "hf_untied"
            hf, units = hf_make(ctx, tie)
        except ImportError as e:
            return {"skipped": f"transformers not importable: {e}"}
        return fsdp_mode(ctx, hf, units, cb=True, plain_to_empty=mode == "hf_tied_to_empty",
                         tie_names=("lm_head.weight", "model.embed_tokens.weight"))
    raise ValueError(f"unknown mode {mode!r}; modes: {sorted(set(ALL_MODES))}")


def warmup(ctx: Ctx) -> None:
    """NCCL communicators, CUDA context, allocator and the extension's streams, before anything is timed."""
    t = torch.ones(1 << 20, device=ctx.device)
    dist.broadcast(t, 0)
    coalesced_bcast.broadcast_tensors([t], 0)
    old = ctx.small
    ctx.small = True
    for mode in ("fsdp1_cb", "ddp_cb", "ddp_base") + (("fsdp1_base",) if ctx.cuda else ()):
        run_mode(ctx, mode)
    ctx.small = old
    clean(ctx.cuda)


# --------------------------------------------------------------------------------------------- main

def summarize(rows: list[dict]) -> dict:
    """Per (mode, rank): the median repetition by time among those not cut at each sync (all, if every
    one was), the sync-window figures from the one that was, then the targets."""
    reps: dict[tuple, list] = {}
    for r in rows:
        if "seconds" in r:
            reps.setdefault((r["mode"], r["rank"]), []).append(r)
    timed = {k: [r for r in v if not r.get("windows", True)] or v for k, v in reps.items()}
    best = {k: sorted(v, key=lambda r: r["seconds"])[(len(v) - 1) // 2] for k, v in timed.items()}
    cut = {k: next((r for r in v if r.get("windows", True)), None) for k, v in reps.items()}
    out: dict = {"mode": "summary", "all_correct": all(r.get("correct", True) for r in rows),
                 "errors": [f"{r['mode']}@{r['rank']}: {r['error']}" for r in rows if "error" in r]}

    def get(mode, rank, key):
        if key.startswith("sync_"):
            return (cut.get((mode, rank)) or {}).get(key)
        return best.get((mode, rank), {}).get(key)

    ranks = sorted({r["rank"] for r in rows})
    for kind in ("fsdp1", "ddp"):
        b, c = f"{kind}_base", f"{kind}_cb"
        for rank in ranks:
            for key in ("seconds", "init_fn_seconds", "unit_sync_seconds", "lay_out_seconds", "flatten_shard_seconds",
                        "cb_agree_seconds", "cb_agree_wait_seconds", "cb_enqueue_seconds", "sync_seconds",
                        "extra_alloc_GiB", "extra_reserved_GiB", "sync_peak_alloc_GiB", "sync_peak_reserved_GiB",
                        "sync_extra_alloc_GiB", "sync_extra_reserved_GiB"):
                vb, vc = get(b, rank, key), get(c, rank, key)
                if vb is not None or vc is not None:
                    out[f"{kind}.r{rank}.{key}"] = [vb, vc]
    # Modes run one after another in one process and a finished FSDP model is not always freed at
    # once, so peaks are taken over each mode's own starting point (the anchors' rank 1 starts empty).
    p1 = get("fsdp1_cb", 1, "extra_alloc_GiB")
    if p1 is not None:
        out["target.fsdp1_rank1_peak_alloc<=10.4"] = p1 <= FSDP1_RANK1_PEAK_TARGET
        out["target.fsdp1_peak_reserved<=base"] = all(
            (get("fsdp1_cb", r, "extra_reserved_GiB") or 0) <= (get("fsdp1_base", r, "extra_reserved_GiB") or 0)
            for r in ranks)
    ring = max((get("ddp_cb", r, "ring_MiB") or 0) for r in ranks) / 1024
    if get("ddp_cb", 0, "sync_extra_alloc_GiB") is not None:
        # The ring plus the copy table and the agreement's few KiB: allow 1 MiB over the ring.
        out["target.ddp_sync_extra_alloc<=ring"] = all(
            (get("ddp_cb", r, "sync_extra_alloc_GiB") or 0) <= ring + 1 / 1024 for r in ranks)
    for kind in ("fsdp1", "ddp"):
        tb = [get(f"{kind}_base", r, "seconds") for r in ranks]
        tc = [get(f"{kind}_cb", r, "seconds") for r in ranks]
        if all(x is not None for x in tb + tc):
            out[f"target.{kind}_time_no_slower(median, max over ranks, 5% slack)"] = max(tc) <= 1.05 * max(tb)
        for mode in (f"{kind}_base", f"{kind}_cb"):
            out[f"{mode}.seconds_timed_reps"] = sorted(r["seconds"] for r in timed.get((mode, 0), []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(ALL_MODES), help="comma-separated; default: all, FSDP1 five times and DDP three, interleaved")
    ap.add_argument("--out", default=None, help="JSON lines file (default: $OUT/init.jsonl or ./init_bench.jsonl)")
    ap.add_argument("--small", action="store_true", help="scaled-down models (the default on CPU)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs exist")
    ap.add_argument("--profile-dir", default=os.environ.get("LOGS", "."),
                    help="where the *_profile modes write their cProfile tables, one per rank")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    out = args.out or (os.path.join(os.environ["OUT"], "init.jsonl") if os.environ.get("OUT") else "init_bench.jsonl")

    dist_setup.init(cpu=args.cpu, timeout=timedelta(seconds=180))
    ctx = Ctx(args)
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        open(out, "w").close()
    warmup(ctx)

    rows: list[dict] = []
    reps: dict[str, int] = {}
    for mode in modes:
        reps[mode] = reps.get(mode, 0) + 1
        try:
            row = run_mode(ctx, mode, reps[mode])
        except Exception as e:  # every mode is collective: a rank's error is reported, the run goes on
            row = {"error": f"{type(e).__name__}: {e}"[:2000], "correct": False}
        clean(ctx.cuda)
        row = dict(mode=mode, rep=reps[mode], rank=ctx.rank, world=ctx.world, device=str(ctx.device),
                   small=ctx.small, torch=torch.__version__, **row)
        every = [None] * ctx.world
        dist.all_gather_object(every, row)
        rows += every
        if ctx.rank == 0:
            with open(out, "a") as f:
                for r in every:
                    f.write(json.dumps(r) + "\n")
                    print(json.dumps(r), flush=True)
    if ctx.rank == 0:
        summary = summarize(rows)
        with open(out, "a") as f:
            f.write(json.dumps(summary) + "\n")
        print(json.dumps(summary), flush=True)
        print(table(summary), flush=True)
    dist.destroy_process_group()


def table(summary: dict) -> str:
    """The summary as one fixed table: per kind and rank, torch's sync against ours (median time, memory)."""
    cols = [("kind", 6), ("rank", 4), ("sync", 15), ("time(ms)", 9), ("xalloc(GiB)", 11), ("xresv(GiB)", 10),
            ("sync xalloc(GiB)", 16)]
    rows = []
    for key in sorted(k for k in summary if k.endswith(".seconds") and k.count(".") == 2):
        kind, rank, _ = key.split(".")
        for i, side in enumerate(("torch", "coalesced_bcast")):
            def get(name):
                v = (summary.get(f"{kind}.{rank}.{name}") or [None, None])[i]
                return None if v is None else f"{v:.3f}"
            t = summary[key][i]
            rows.append((kind, rank[1:], side, None if t is None else f"{t * 1e3:.1f}", get("extra_alloc_GiB"),
                         get("extra_reserved_GiB"), get("sync_extra_alloc_GiB")))
    targets = [f"{k}: {'MET' if v else 'MISSED'}" for k, v in summary.items() if k.startswith("target.")]
    return "\n".join([dist_setup.table(cols, rows), *targets])


if __name__ == "__main__":
    main()

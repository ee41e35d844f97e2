"""Weight refit, side by side in one run: a trainer sharded by FSDP2 over 2 GPUs streams its weights to
one engine process on GPU 1, joined to trainer rank 0 by its own NCCL group.

Rows: coalesced_bcast (RefitSender / RefitReceiver, kept plans, in place into the engine's tensors)
against (a) per tensor: full_tensor() on the trainer, then a broadcast of it into the engine's tensor,
and (b) packed, as vLLM's packed producer does it: full_tensor() per parameter, torch.cat into two
1 GiB buffers used in turn, broadcast, split into the engine's tensors. Then an unsharded sender (the
whole state on trainer rank 0, as views of one buffer) against a flat broadcast of that buffer, and
100 refits in a row (verified, memory after each). Every coalesced_bcast refit of the timed rows is
followed by a bitwise check of every engine tensor against the source pattern.

State: Qwen3-30B-A3B-shaped, bf16, Hugging Face layout (48 layers, 128 experts of 2048x768 matrices,
~18.9k tensors, ~57 GiB); fully_shard per layer and at the root.

GPU (2 GPUs):   python3 -m torch.distributed.run --standalone --nproc-per-node 3 bench/refit_bench.py
CPU smoke test: python3 -m torch.distributed.run --standalone --nproc-per-node 3 bench/refit_bench.py --cpu
One JSON line per rank and measurement, then a 'summary' line with the targets (rank 0 writes them all to --out),
and the summary as one table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import coalesced_bcast
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402
from fsdp2_load import local_range, pattern  # noqa: E402

GiB, MiB = 2**30, 2**20
DTYPE = torch.bfloat16
DEVICE_OF_RANK = (0, 1, 1)


def qwen3_moe_specs(a) -> list[tuple[str, tuple[int, ...]]]:
    specs = [("model.embed_tokens.weight", (a.vocab, a.hidden))]
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    for i in range(a.layers):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", (q, a.hidden)), (p + "self_attn.k_proj.weight", (kv, a.hidden)),
                  (p + "self_attn.v_proj.weight", (kv, a.hidden)), (p + "self_attn.o_proj.weight", (a.hidden, q)),
                  (p + "self_attn.q_norm.weight", (a.head_dim,)), (p + "self_attn.k_norm.weight", (a.head_dim,)),
                  (p + "mlp.gate.weight", (a.experts, a.hidden))]
        for e in range(a.experts):
            x = f"{p}mlp.experts.{e}."
            specs += [(x + "gate_proj.weight", (a.inter, a.hidden)), (x + "up_proj.weight", (a.inter, a.hidden)),
                      (x + "down_proj.weight", (a.hidden, a.inter))]
        specs += [(p + "input_layernorm.weight", (a.hidden,)), (p + "post_attention_layernorm.weight", (a.hidden,))]
    return specs + [("model.norm.weight", (a.hidden,)), ("lm_head.weight", (a.vocab, a.hidden))]


def build_trainer(specs, device, mesh) -> nn.Module:
    """Modules along the dotted names, parameters on meta; fully_shard per layer and at the root; to_empty."""
    root = nn.Module()
    for name, shape in specs:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=DTYPE, device="meta")))
    for layer in root.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    root.to_empty(device=device)
    return root


class Bench:
    def __init__(self, a):
        self.a = a
        self.rank = int(os.environ["RANK"])
        self.cpu = a.cpu or not torch.cuda.is_available()
        if self.cpu:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        else:
            self.device = torch.device("cuda", DEVICE_OF_RANK[self.rank])
            torch.cuda.set_device(self.device)
            # No NCCL collective runs on the world (two ranks share GPU 1): gloo there, NCCL in the subgroups.
            dist.init_process_group("cpu:gloo,cuda:nccl")
        self.trainer = dist.new_group([0, 1])
        self.refit = dist.new_group([0, 2])
        self.role = "engine" if self.rank == 2 else "trainer"
        self.rows: list[dict] = []

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def emit(self, **row):
        row.update(bench="refit", rank=self.rank, role=self.role, torch=torch.__version__,
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if not self.cpu else None,
                   device=torch.cuda.get_device_name() if not self.cpu else "cpu")
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def measure(self, what: str, fn, **extra) -> dict:
        """fn on every rank between barriers; wall time, and the peak memory above the start on this rank."""
        out, sec, extra_a, extra_r = dist_setup.timed(fn, not self.cpu)
        row = dict(what=what, sec=sec, **extra)
        if not self.cpu:
            row.update(extra_alloc_MiB=extra_a / MiB, extra_reserved_MiB=extra_r / MiB)
        if isinstance(out, coalesced_bcast.RefitStats):
            row.update(ring_MiB=out.ring_bytes / MiB, buckets=out.buckets, gbytes=out.bytes / 1e9,
                       direct_buckets=out.direct_buckets)
        self.emit(**row)
        return row

    # -- the state --------------------------------------------------------------------------------

    def fill_trainer(self, model):
        with torch.no_grad():
            for i, (_, p) in enumerate(model.named_parameters()):
                local, off = local_range(p)
                local.view(torch.int16).view(-1).copy_(pattern(off, off + local.numel(), i, self.device))

    def check_engine(self, dests: list[torch.Tensor]) -> int:
        """Engine tensors that differ from the source pattern, bitwise."""
        bad = 0
        for i, t in enumerate(dests):
            bad += not torch.equal(t.view(torch.int16).view(-1), pattern(0, t.numel(), i, self.device))
        return bad

    # -- the rows ---------------------------------------------------------------------------------

    def run(self):
        a = self.a
        specs = qwen3_moe_specs(a)
        total = sum(math.prod(s) for _, s in specs) * 2
        self.emit(what="state", tensors=len(specs), gbytes=total / 1e9)
        model = dests = named = None
        if self.role == "trainer":
            mesh = DeviceMesh.from_group(self.trainer, self.device.type)
            model = build_trainer(specs, self.device, mesh)
            self.fill_trainer(model)
            params = list(model.named_parameters())
        else:
            dests = [torch.empty(s, dtype=DTYPE, device=self.device) for _, s in specs]
            named = dict(zip((n for n, _ in specs), dests))
        self.sync()

        for bucket_mib in a.buckets:
            if self.role == "trainer":
                ours = coalesced_bcast.RefitSender(params, self.refit if self.rank == 0 else None,
                                                   bucket_bytes=bucket_mib * MiB)
                step = lambda **kw: ours.send(**kw)  # noqa: E731
            else:
                ours = coalesced_bcast.RefitReceiver(self.refit, tensors=named)
                step = lambda **kw: ours.receive()  # noqa: E731
            self.measure("coalesced_bcast first (plans)", step, bucket_MiB=bucket_mib)
            for rep in range(a.reps):
                self.measure("coalesced_bcast", step, bucket_MiB=bucket_mib, rep=rep)
            wrong = self.check_engine(dests) if dests is not None else 0
            self.emit(what="bitwise check", bucket_MiB=bucket_mib, wrong=wrong)
            if bucket_mib == a.buckets[0]:
                self.soak(step, dests)
                self.callback(ours if self.role == "trainer" else None, named, dests, bucket_mib)
            del ours, step

        if self.role == "engine":
            for t in dests:
                t.zero_()
        self.measure("per-tensor full_tensor+broadcast", lambda: self.per_tensor(params if model else dests))
        if dests is not None:
            self.emit(what="bitwise check", baseline="per-tensor", wrong=self.check_engine(dests))
        for t in dests or []:
            t.zero_()
        self.measure("packed 2x1GiB cat+broadcast", lambda: self.packed(params if model else dests))
        if dests is not None:
            self.emit(what="bitwise check", baseline="packed", wrong=self.check_engine(dests))

        del model, dests
        params = named = None
        if not self.cpu:
            torch.cuda.empty_cache()
        self.unsharded(specs)

    def callback(self, sender, named, dests, bucket_mib):
        """The engine through a callback, as vLLM's load_weights takes weights: each (name, view) copied into
        its tensor by the callback (torch copy_ per tensor), pieces of split tensors into their rows."""
        if self.role == "engine":
            for t in dests:
                t.zero_()

            @torch.no_grad()
            def on_weights(batch):
                for name, view in batch:
                    named[name].copy_(view)
                for name, flat, first, _shape in batch.pieces:
                    named[name].view(-1)[first:first + flat.numel()].copy_(flat)
            receiver = coalesced_bcast.RefitReceiver(self.refit, on_weights=on_weights)
            step = receiver.receive
        else:
            step = sender.send
        self.measure("coalesced_bcast callback first (plans)", step, bucket_MiB=bucket_mib)
        for rep in range(self.a.reps):
            self.measure("coalesced_bcast callback", step, bucket_MiB=bucket_mib, rep=rep)
        if dests is not None:
            self.emit(what="bitwise check", bucket_MiB=bucket_mib, receiver="callback", wrong=self.check_engine(dests))

    def soak(self, step, dests):
        """a.soak refits in a row, each verified; memory after each (growth = last - first)."""
        if not self.cpu:
            torch.cuda.synchronize()
            first = None
        t0 = time.perf_counter()
        trajectory = {}  # after refit n (1-based): allocated, reserved MiB (a step or a creep)
        for i in range(self.a.soak):
            step(verify=True)
            if not self.cpu:
                torch.cuda.synchronize()
                now = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
                first = first or now
                if i + 1 in (1, 2, 3, 5, 10, 25, 50, 75, 100) or i + 1 == self.a.soak:
                    trajectory[i + 1] = [round(now[0] / MiB, 1), round(now[1] / MiB, 1)]
        row = dict(what="soak", refits=self.a.soak, verified=True, sec_per_refit=(time.perf_counter() - t0) / max(
            1, self.a.soak))
        if not self.cpu and self.a.soak:
            row.update(growth_alloc_MiB=(now[0] - first[0]) / MiB, growth_reserved_MiB=(now[1] - first[1]) / MiB,
                       alloc_reserved_MiB_after=trajectory)
        self.emit(**row)

    @torch.no_grad()
    def per_tensor(self, items):
        for x in items:
            if self.role == "trainer":
                full = x[1].full_tensor()
                if self.rank == 0:
                    dist.broadcast(full, 0, group=self.refit)
            else:
                dist.broadcast(x, 0, group=self.refit)

    @torch.no_grad()
    def packed(self, items, cap=GiB):
        """vLLM's packed producer: tensors cat'ed into two 1 GiB buffers in turn, each broadcast while the
        other fills; the engine splits each buffer into its tensors."""
        bufs = [torch.empty(cap // 2, dtype=DTYPE, device=self.device) for _ in range(2)]
        works = [None, None]
        cur, batch, used = 0, [], 0

        def flush():
            nonlocal cur, batch, used
            if not batch:
                return
            if works[cur] is not None:
                works[cur].wait()
            buf = bufs[cur][:used]
            if self.role == "trainer":
                if self.rank == 0:
                    torch.cat([t.view(-1) for t in batch], out=buf)
                    works[cur] = dist.broadcast(buf, 0, group=self.refit, async_op=True)
            else:
                dist.broadcast(buf, 0, group=self.refit)
                off = 0
                for t in batch:
                    t.view(-1).copy_(buf[off:off + t.numel()])
                    off += t.numel()
            cur, batch, used = 1 - cur, [], 0

        for x in items:
            t = x[1].full_tensor() if self.role == "trainer" else x
            if used + t.numel() > cap // 2:
                flush()
            batch.append(t)
            used += t.numel()
        flush()
        for w in works:
            if w is not None:
                w.wait()

    def unsharded(self, specs):
        """The whole state on trainer rank 0 as views of one buffer, the engine's likewise: a refit of plain
        tensors (kept plan) against one flat broadcast of the buffer."""
        total = sum(math.prod(s) for _, s in specs)
        if self.rank == 1:
            for _ in range(1 + len(self.a.buckets) * (2 + self.a.reps) + 1 + self.a.reps):  # as ranks 0 and 2 make below
                self.measure("idle", lambda: None)
            return
        flat = torch.empty(total, dtype=DTYPE, device=self.device)
        views, off = [], 0
        for i, (_, s) in enumerate(specs):
            n = math.prod(s)
            if self.rank == 0:
                flat[off:off + n].view(torch.int16).copy_(pattern(0, n, i, self.device))
            views.append(flat[off:off + n].view(s))
            off += n
        names = [n for n, _ in specs]
        self.measure("flat broadcast (unsharded)", lambda: dist.broadcast(flat, 0, group=self.refit))
        for b in self.a.buckets:
            if self.rank == 0:
                ours = coalesced_bcast.RefitSender(list(zip(names, views)), self.refit, bucket_bytes=b * MiB)
                step = ours.send
            else:
                ours = coalesced_bcast.RefitReceiver(self.refit, tensors=dict(zip(names, views)))
                step = ours.receive
            pieces = flat.view(torch.uint8).split(b * MiB)  # the link at the bucket size, nothing around it
            self.measure("flat broadcast in bucket pieces (unsharded)",
                         lambda: [dist.broadcast(p, 0, group=self.refit) for p in pieces], bucket_MiB=b)
            self.measure("coalesced_bcast unsharded first (plans)", step, bucket_MiB=b)
            for rep in range(self.a.reps):
                self.measure("coalesced_bcast unsharded", step, rep=rep, bucket_MiB=b)
            if self.rank == 2:
                self.emit(what="bitwise check", case="unsharded", bucket_MiB=b, wrong=self.check_engine(views))
            del ours, step
        # The same with direct=False: every bucket through the ring slots (a copy on each side), what the
        # broadcast from and into the tensors' own memory saves
        if self.rank == 0:
            step = coalesced_bcast.RefitSender(list(zip(names, views)), self.refit,
                                               bucket_bytes=self.a.buckets[0] * MiB, direct=False).send
        else:
            step = coalesced_bcast.RefitReceiver(self.refit, tensors=dict(zip(names, views)), direct=False).receive
        self.measure("coalesced_bcast unsharded first (plans), direct off", step, bucket_MiB=self.a.buckets[0])
        for rep in range(self.a.reps):
            self.measure("coalesced_bcast unsharded, direct off", step, rep=rep, bucket_MiB=self.a.buckets[0])
        if self.rank == 2:
            self.emit(what="bitwise check", case="unsharded, direct off", wrong=self.check_engine(views))

    def summary(self):
        """Per measurement the slowest rank's time, and the targets, from every rank's rows."""
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, self.rows)
        allrows = [r for rs in rows for r in rs]
        if self.rank != 0:
            return allrows

        def slowest(what, **kw):
            sel = [r for r in allrows if r.get("what") == what and all(r.get(k) == v for k, v in kw.items())]
            if not sel:
                return None
            reps = sorted({r.get("rep") for r in sel}, key=lambda x: (x is None, x))
            return min(max(r["sec"] for r in sel if r.get("rep") == rep) for rep in reps)

        b0 = self.a.buckets[0]
        ours = {b: slowest("coalesced_bcast", bucket_MiB=b) for b in self.a.buckets}
        per_tensor = slowest("per-tensor full_tensor+broadcast")
        packed = slowest("packed 2x1GiB cat+broadcast")
        flat = slowest("flat broadcast (unsharded)")
        flat_pieces = {b: slowest("flat broadcast in bucket pieces (unsharded)", bucket_MiB=b) for b in self.a.buckets}
        unsharded_by = {b: slowest("coalesced_bcast unsharded", bucket_MiB=b) for b in self.a.buckets}
        unsharded = min((s for s in unsharded_by.values() if s), default=None)
        gbytes = next(r["gbytes"] for r in allrows if r.get("what") == "state")
        out = dict(what="summary", gbytes=gbytes, ours_sec={str(b): s for b, s in ours.items()},
                   ours_callback_sec=slowest("coalesced_bcast callback", bucket_MiB=b0),
                   per_tensor_sec=per_tensor, packed_sec=packed, flat_sec=flat,
                   flat_in_bucket_pieces_sec={str(b): s for b, s in flat_pieces.items()},
                   unsharded_sec={str(b): s for b, s in unsharded_by.items()},
                   unsharded_pct_of_flat_by_bucket={str(b): 100 * flat / s for b, s in unsharded_by.items() if s},
                   unsharded_direct_off_sec=slowest("coalesced_bcast unsharded, direct off", bucket_MiB=b0))
        best = min(s for s in ours.values() if s)
        out.update(ours_GBps=gbytes / best, speedup_vs_packed=packed / best, speedup_vs_per_tensor=per_tensor / best,
                   unsharded_pct_of_flat=100 * flat / unsharded if unsharded else None,
                   target_2x_packed="MET" if packed / best >= 2 else "MISSED",
                   target_unsharded_90pct="MET" if unsharded and flat / unsharded >= 0.9 else "MISSED")
        mem = [r for r in allrows if r.get("what") == "coalesced_bcast" and r.get("bucket_MiB") == b0]
        if mem and "extra_alloc_MiB" in mem[0]:
            out.update(extra_MiB_by_rank={r["rank"]: [round(r["extra_alloc_MiB"], 1), round(r["extra_reserved_MiB"], 1),
                                                       round(r["ring_MiB"], 1)] for r in mem if r.get("rep") == 0})
        soak = [r for r in allrows if r.get("what") == "soak"]
        out.update(soak={r["rank"]: {k: r.get(k) for k in ("growth_alloc_MiB", "growth_reserved_MiB", "sec_per_refit",
                                                            "alloc_reserved_MiB_after")}
                         for r in soak},
                   wrong=sum(r.get("wrong", 0) for r in allrows if r.get("what") == "bitwise check"))
        self.emit(**out)
        print(self.table(out), flush=True)
        return allrows

    def table(self, s: dict) -> str:
        """The summary as one fixed table: the slowest rank's best time per method."""
        gb = s["gbytes"]
        rows = [("coalesced_bcast", b, t) for b, t in s["ours_sec"].items()]
        rows += [("coalesced_bcast, callback", str(self.a.buckets[0]), s["ours_callback_sec"]),
                 ("per tensor", None, s["per_tensor_sec"]), ("packed 2x1GiB", None, s["packed_sec"]),
                 ("flat broadcast, unsharded", None, s["flat_sec"])]
        rows += [("flat in bucket pieces, unsharded", b, t) for b, t in s["flat_in_bucket_pieces_sec"].items()]
        rows += [("coalesced_bcast, unsharded", b, t) for b, t in s["unsharded_sec"].items()]
        rows += [("coalesced_bcast, unsharded, direct=False", str(self.a.buckets[0]), s["unsharded_direct_off_sec"])]
        cols = [("method", 40), ("bucket(MiB)", 11), ("time(s)", 8), ("GB/s", 7), ("xpacked", 7)]
        where = torch.cuda.get_device_name() if not self.cpu else "cpu"
        return (f"# refit: {gb:.1f} GB, {next(r['tensors'] for r in self.rows if r.get('what') == 'state')} tensors, "
                f"{where}, torch {torch.__version__}; wrong tensors in every check: {s['wrong']}\n"
                + dist_setup.table(cols, [(m, b, None if t is None else f"{t:.4f}", None if not t else gb / t,
                                           None if not t or not s["packed_sec"] else s["packed_sec"] / t)
                                          for m, b, t in rows]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "refit.jsonl") if os.environ.get("OUT") else None)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU with tiny shapes (smoke test)")
    p.add_argument("--buckets", default="64,256", help="MiB, comma-separated: one coalesced_bcast row set each")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--soak", type=int, default=100, help="verified refits in a row (memory growth)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    a = p.parse_args()
    a.buckets = [int(x) for x in a.buckets.split(",") if x]
    if a.cpu:
        a.layers, a.experts, a.hidden, a.inter, a.heads, a.kv_heads, a.head_dim, a.vocab = 2, 4, 64, 32, 4, 2, 16, 500
        a.buckets, a.soak = [1, 4], min(a.soak, 5)
    b = Bench(a)
    b.run()
    rows = b.summary()
    if b.rank == 0 and a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

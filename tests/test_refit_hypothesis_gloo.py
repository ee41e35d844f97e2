"""Random refits over gloo: a trainer of two ranks streams to an engine process, every example in ONE 3-rank
process group, checked bit for bit on the engine.

Each example: tensors of random shapes (0-3 dims, empty ones too) and dtypes, each a DTensor sharded by rows
over the trainer's two ranks (``Shard(0)`` as torch.chunk splits: uneven, or with nothing on one rank),
a replicated DTensor, or a plain tensor that every trainer rank holds whole; a wire dtype per tensor (its own
or one the pack casts it to); the trainer rank that sends (0 or 1); buckets of 4096 bytes and up, at any
multiple of 16, so tensors split across buckets at odd places; ring depths 1-3. The engine takes the stream
into its own tensors (in its own dtypes: a second cast, in the unpack; some names mapped to None and left
alone) or through a callback that reassembles every tensor from its batches and pieces. Two steps with new
values on one kept plan, the second verified; before the second, in some examples, a tensor re-allocated on a
trainer rank or on the engine: every rank that takes part must raise, naming it, with nothing written, and the
refit then goes through (the trainer planning again, or a new receiver). Where a value is cast, a NaN may
arrive as another NaN (see test_load_hypothesis_gloo.same_values); every other bit must match
``torch.empty(shape, engine_dtype).copy_(full.to(wire_dtype))``.

Each example runs on every rank (ranked_hypothesis.py): each builds the same full values from the example's
seed, the trainer ranks their shards, the engine its poisoned destinations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from dist_utils import run_ranks
from ranked_hypothesis import examples_on_ranks
from test_load_hypothesis_gloo import _cast_targets, same_values
from zoo import DTYPES, bits, fill_random_bytes, same_bits

from coalesced_bcast import AgreementError, RefitReceiver, RefitSender

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard
from torch.distributed.device_mesh import DeviceMesh

EXAMPLES = 60
TRAINER, ENGINE = (0, 1), 2
# What a refit casts: _util._CASTABLE less bool, whose casts _cast_targets omits.
_CASTS = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64}


def _targets(dtype: torch.dtype) -> list[torch.dtype]:
    return [d for d in _cast_targets(dtype) if d == dtype or (d in _CASTS and dtype in _CASTS)]


@st.composite
def specs(draw):
    entries = []
    for _ in range(draw(st.integers(1, 8))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 40)), min_size=ndim, max_size=ndim)))
        dtype = draw(st.sampled_from(DTYPES))
        wire = draw(st.sampled_from(_targets(dtype)))
        entries.append(dict(shape=shape, dtype=dtype, wire=wire, engine=draw(st.sampled_from(_targets(wire))),
                            placement=draw(st.sampled_from(["S", "S", "R", "P"] if ndim else ["R", "P"])),
                            skip=draw(st.integers(0, 5)) == 0))
    return dict(entries=entries, seed=draw(st.integers(0, 2**31 - 1)), sender=draw(st.integers(0, 1)),
                bucket_bytes=4096 + 16 * draw(st.one_of(st.integers(0, 4), st.integers(0, 1024))),
                ring_depth=draw(st.integers(1, 3)), sender_depth=draw(st.integers(1, 3)),
                callback=draw(st.booleans()),
                # before step 1: a tensor re-allocated on a trainer rank or on the engine (refused everywhere,
                # nothing written; then replanned, or a new receiver), which entry (modulo those with bytes)
                realloc=draw(st.sampled_from([None, None, "trainer0", "trainer1", "engine"])),
                realloc_entry=draw(st.integers(0, 7)))


def _full(spec, step: int) -> dict[str, torch.Tensor]:
    """Every tensor's full value at `step`: random bytes (NaN payloads, -0.0), the same on every rank."""
    g = torch.Generator().manual_seed(spec["seed"] * 7 + step)
    out = {}
    for i, e in enumerate(spec["entries"]):
        t = torch.empty(e["shape"], dtype=e["dtype"])
        fill_random_bytes(t, g)
        out[f"w{i}"] = t
    return out


def _row_shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    """Trainer rank `rank`'s rows, as torch.chunk(2) splits them (FSDP2's Shard(0)); none when chunk makes fewer."""
    chunks = full.chunk(2, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else full[full.shape[0]:].clone()


def _trainer_tensors(spec, full: dict, mesh: DeviceMesh, rank: int) -> dict:
    out = {}
    for (name, value), e in zip(full.items(), spec["entries"]):
        if e["placement"] == "S":
            out[name] = DTensor.from_local(_row_shard(value, rank), mesh, [Shard(0)], run_check=False,
                                           shape=value.shape, stride=value.stride())
        elif e["placement"] == "R":
            out[name] = DTensor.from_local(value.clone(), mesh, [Replicate()], run_check=False)
        else:
            out[name] = value.clone()
    return out


def _write_step(tensors: dict, full: dict, rank: int, spec) -> None:
    """An optimizer step: the new values written into the same storage."""
    for (name, t), e in zip(tensors.items(), spec["entries"]):
        local = t._local_tensor if isinstance(t, DTensor) else t
        local.copy_(_row_shard(full[name], rank) if e["placement"] == "S" else full[name])


def _expected(spec, full: dict) -> dict:
    return {name: torch.empty(e["shape"], dtype=e["engine"]).copy_(full[name].to(e["wire"]))
            for (name, e) in zip(full, spec["entries"])}


def _cast(e) -> bool:
    return e["wire"] != e["dtype"] or e["engine"] != e["wire"]


class _Reassembler:
    """An engine's callback: every tensor rebuilt in the wire's dtype from whole views, pieces and the empties
    batch, each element written exactly once."""

    def __init__(self, spec):
        self.spec = spec
        self.flat = {f"w{i}": _poisoned((torch.Size(e["shape"]).numel(),), e["wire"])
                     for i, e in enumerate(spec["entries"])}
        self.hits = {name: torch.zeros(t.numel(), dtype=torch.int32) for name, t in self.flat.items()}
        self.problems: list[str] = []

    def __call__(self, batch) -> None:
        for name, view in batch:
            e = self.spec["entries"][int(name[1:])]
            if tuple(view.shape) != tuple(e["shape"]) or view.dtype != e["wire"]:
                self.problems.append(f"{name}: a view {tuple(view.shape)} {view.dtype}, sent {e['shape']} {e['wire']}")
                continue
            self.flat[name].copy_(view.reshape(-1))
            self.hits[name] += 1
        for name, flat, first, shape in batch.pieces:
            e = self.spec["entries"][int(name[1:])]
            if tuple(shape) != tuple(e["shape"]) or flat.dim() != 1 or flat.dtype != e["wire"]:
                self.problems.append(f"{name}: a piece of {tuple(shape)} {flat.dtype}, sent {e['shape']} {e['wire']}")
                continue
            self.flat[name][first:first + flat.numel()].copy_(flat)
            self.hits[name][first:first + flat.numel()] += 1

    def check(self, want_wire: dict) -> list[str]:
        out = list(self.problems)
        for (name, flat), e in zip(self.flat.items(), self.spec["entries"]):
            if flat.numel() and not bool((self.hits[name] == 1).all()):
                out.append(f"{name}: elements written {sorted(set(self.hits[name].tolist()))} times")
            got, want = flat.view(e["shape"]), want_wire[name]
            if not (same_values(got, want) if e["wire"] != e["dtype"] else same_bits(got, want)):
                out.append(f"{name}: differs")
        return out


def _poisoned(shape, dtype) -> torch.Tensor:
    """Every element's bits the integer 7, a bool's 1, through zoo's bits view (torch 2.4 cannot fill float8
    tensors on the CPU; a bool byte of 7 is not a bool, and copies of it may read 1)."""
    t = torch.empty(shape, dtype=dtype)
    bits(t).fill_(1 if dtype == torch.bool else 7)
    return t


def _realloc_target(spec) -> tuple[str, int] | None:
    """(who, entry) re-allocated before step 1 where the spec's choice can apply, else None: an entry with bytes
    on that rank, on a trainer rank that takes part in the send (a shard exists, or it is the sender), or on the
    engine in a tensor it writes."""
    who = spec["realloc"]
    if who is None:
        return None
    entries = spec["entries"]
    if who == "engine":
        ok = [i for i, e in enumerate(entries) if not spec["callback"] and not e["skip"]
              and torch.Size(e["shape"]).numel() > 0]
    else:
        r = int(who[-1])
        sharded = any(e["placement"] == "S" for e in entries)
        if not sharded and r != spec["sender"]:
            return None

        def local_numel(e):
            n = torch.Size(e["shape"]).numel()
            if e["placement"] != "S" or n == 0:
                return n
            rows = e["shape"][0]
            mine = _row_shard(torch.empty(rows, 0), r).shape[0]
            return n // rows * mine
        ok = [i for i, e in enumerate(entries) if local_numel(e) > 0]
    return (who, ok[spec["realloc_entry"] % len(ok)]) if ok else None


def _takes_part(spec, rank: int) -> bool:
    return rank == ENGINE or rank == spec["sender"] or any(e["placement"] == "S" for e in spec["entries"])


def run_example(rank: int, spec, groups: dict) -> bool:
    sender = spec["sender"]
    refit = groups[sender] if rank in (sender, ENGINE) else None
    problems: list[str] = []
    realloc = _realloc_target(spec)
    full = _full(spec, 0)

    def refused(call, step) -> bool:
        """call() raises the AgreementError that names the re-allocated tensor (where this rank takes part)."""
        try:
            call()
        except AgreementError as e:
            if f"w{realloc[1]}" not in str(e) or "re-allocated" not in str(e):
                problems.append(f"step {step}: refused for another reason: {e}")
            return True
        if _takes_part(spec, rank):
            problems.append(f"step {step}: w{realloc[1]} re-allocated on {realloc[0]}, and the refit went ahead")
        return False

    if rank in TRAINER:
        tensors = _trainer_tensors(spec, full, groups["mesh"], rank)
        wires = {f"w{i}": e["wire"] for i, e in enumerate(spec["entries"])}
        s = RefitSender(list(tensors.items()), refit, src=0, sender_rank=sender, dtype=lambda n, t: wires[n],
                        bucket_bytes=spec["bucket_bytes"], ring_depth=spec["sender_depth"])
        for step in range(2):
            _write_step(tensors, _full(spec, step), rank, spec)
            if step == 1 and realloc is not None:
                if realloc[0] == f"trainer{rank}":
                    t = tensors[f"w{realloc[1]}"]
                    local = t._local_tensor if isinstance(t, DTensor) else t
                    local.data = local.data.clone()
                refused(s.send, step)
            # A trainer's change is planned again; the engine's takes a new receiver, and this sends as before.
            s.send(verify=step == 1, replan=step == 1 and realloc is not None and realloc[0] != "engine")
    else:
        poison = {f"w{i}": _poisoned(e["shape"], e["engine"]) for i, e in enumerate(spec["entries"])}
        keep = {k: v.clone() for k, v in poison.items()}
        skipped = {f"w{i}" for i, e in enumerate(spec["entries"]) if e["skip"]}
        name_map = {k: None for k in skipped}
        grab = _Reassembler(spec)

        def receiver():
            if spec["callback"]:
                return RefitReceiver(refit, src=0, on_weights=lambda b: grab(b), ring_depth=spec["ring_depth"])
            return RefitReceiver(refit, src=0, tensors=poison, name_map=name_map, ring_depth=spec["ring_depth"])
        r = receiver()
        for step in range(2):
            want = _expected(spec, _full(spec, step))
            grab.__init__(spec)
            if step == 1 and realloc is not None:
                before = {k: v.clone() for k, v in poison.items()}
                if realloc[0] == "engine":
                    poison[f"w{realloc[1]}"].data = poison[f"w{realloc[1]}"].data.clone()
                refused(r.receive, step)
                if any(not same_bits(poison[k], before[k]) for k in poison):
                    problems.append(f"step {step}: a refused refit wrote a tensor")
                if any(int(h.sum()) for h in grab.hits.values()):
                    problems.append(f"step {step}: a refused refit called back")
                if realloc[0] == "engine":
                    r = receiver()
            r.receive()
            if spec["callback"]:
                wire = {f"w{i}": _full(spec, step)[f"w{i}"].to(e["wire"]) for i, e in enumerate(spec["entries"])}
                problems += [f"step {step}: {p}" for p in grab.check(wire)]
            else:
                for (name, got), e in zip(poison.items(), spec["entries"]):
                    if name in skipped:
                        ok = same_bits(got, keep[name])
                    else:
                        ok = same_values(got, want[name]) if _cast(e) else same_bits(got, want[name])
                    if not ok:
                        problems.append(f"step {step}: {name} ({e}) {'written' if name in skipped else 'differs'}")
    for p in problems:
        print(f"rank {rank}: {p}", flush=True)
    return not problems


def _body(rank, world_size, out_dir, examples):
    groups = {0: dist.new_group([TRAINER[0], ENGINE]), 1: dist.new_group([TRAINER[1], ENGINE])}
    trainer = dist.new_group(list(TRAINER))
    groups["mesh"] = DeviceMesh.from_group(trainer, "cpu") if rank in TRAINER else None
    explicit = [
        # one row: torch.chunk gives trainer rank 1 nothing; an empty tensor; a cast both ways; callback
        dict(entries=[dict(shape=(1, 5), dtype=torch.float32, wire=torch.bfloat16, engine=torch.float32,
                           placement="S", skip=False),
                      dict(shape=(0, 3), dtype=torch.float16, wire=torch.float16, engine=torch.float16,
                           placement="S", skip=False),
                      dict(shape=(37, 3), dtype=torch.int64, wire=torch.int32, engine=torch.float64,
                           placement="S", skip=False)],
             seed=1, sender=1, bucket_bytes=4096 + 16, ring_depth=1, sender_depth=3, callback=True,
             realloc="trainer0", realloc_entry=0),
        # (found with COALESCED_BCAST_TEST_SEED=23) 256 + 16 (4 bytes, padded) + 3,840 bytes fill the 4,112-byte
        # bucket; the empty tensor after them opened a bucket of 0 bytes, which the engine refused
        dict(entries=[dict(shape=(16,), dtype=torch.complex128, wire=torch.complex128, engine=torch.complex128,
                           placement="P", skip=False),
                      dict(shape=(2,), dtype=torch.float64, wire=torch.bfloat16, engine=torch.float64,
                           placement="P", skip=True),
                      dict(shape=(8, 3, 20), dtype=torch.float16, wire=torch.float64, engine=torch.float16,
                           placement="S", skip=False),
                      dict(shape=(0, 3), dtype=torch.float8_e4m3fn, wire=torch.float8_e4m3fn,
                           engine=torch.float8_e4m3fn, placement="R", skip=False)],
             seed=9509166, sender=0, bucket_bytes=4112, ring_depth=3, sender_depth=2, callback=False,
             realloc=None, realloc_entry=0),
    ]
    examples_on_ranks(rank, specs(), lambda spec: run_example(rank, spec, groups), examples, out_dir, explicit)
    dist.barrier()


def test_random_refits_bitwise(tmp_path):
    run_ranks(3, _body, str(tmp_path), EXAMPLES, timeout=600)
    assert int((tmp_path / "count").read_text()) >= EXAMPLES

"""Weight refit over gloo: a trainer of 2 ranks (row-sharded DTensors) streams to an engine process in its
own group, every step: bitwise in the engine's dtype, in place or through a callback into fused
parameters with a name mapping, plans kept across steps, and a structure change refused on every rank."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from coalesced_bcast import AgreementError, RefitReceiver, RefitSender, init_refit_group
from dist_utils import run_ranks
from zoo import fill_random_bytes, same_bits

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard
from torch.distributed.device_mesh import DeviceMesh

TRAINER, ENGINE = (0, 1), 2
H, KV, FF, VOCAB = 16, 8, 24, 300  # lm_head: 300 x 16 bf16 = 9600 bytes, over two 4 KiB buckets


def _full_state(step: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights at `step` in the Hugging Face layout (random bytes: NaN payloads, -0.0),
    plus an int64 buffer; the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    shapes = {"model.embed_tokens.weight": (37, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (KV, H),
                       p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, H),
                       p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                       p + "mlp.down_proj.weight": (H, FF), p + "input_layernorm.weight": (H,)})
    shapes.update({"model.norm.weight": (H,), "lm_head.weight": (VOCAB, H), "model.odd.weight": (5, 3)})
    state = {}
    for name, shape in shapes.items():
        t = torch.empty(shape)
        fill_random_bytes(t, g)
        state[name] = t
    state["model.step"] = torch.tensor([step, -step], dtype=torch.int64)
    return state


def _as_dtensors(state: dict, mesh: DeviceMesh, rank: int) -> dict:
    """Row shards as FSDP2 holds them (torch.chunk's split: 37 rows -> 19 + 18), the buffer replicated."""
    out = {}
    for name, full in state.items():
        if full.dtype == torch.int64:
            out[name] = DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
        else:
            local = full.chunk(2, dim=0)[rank].clone()
            out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                           stride=full.stride())
    return out


def _groups(rank: int, stateless: bool):
    trainer = dist.new_group(list(TRAINER))
    if not stateless:
        return trainer, dist.new_group([TRAINER[0], ENGINE])
    # A refit group of its own, met at a store of its own (the port handed out through the world's store).
    world_store = dist.distributed_c10d._get_default_store()
    refit = None
    if rank == TRAINER[0]:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        world_store.set("refit_port", str(store.port))
        refit = init_refit_group(None, 0, 0, 2, device="cpu", store=store)
    elif rank == ENGINE:
        store = dist.TCPStore("127.0.0.1", int(world_store.get("refit_port")), 2, False)
        refit = init_refit_group(None, 0, 1, 2, device="cpu", store=store)
    return trainer, refit


def _update(dtensors: dict, state: dict, rank: int) -> None:
    """An optimizer step: new values written into the same shards."""
    for name, dt in dtensors.items():
        full = state[name]
        dt._local_tensor.copy_(full if full.dtype == torch.int64 else full.chunk(2, dim=0)[rank])


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _inplace_body(rank, world_size, stateless):
    trainer, refit = _groups(rank, stateless)
    state = _full_state(0)
    if rank in TRAINER:
        mesh = DeviceMesh.from_group(trainer, "cpu")
        dts = _as_dtensors(state, mesh, rank)
        sender = RefitSender(list(dts.items()), refit if rank == TRAINER[0] else None, dtype=torch.bfloat16,
                             bucket_bytes=4096, ring_depth=2)
        for step in range(3):
            _update(dts, _full_state(step), rank)
            stats = sender.send(verify=step == 2)
            assert stats.planned == (step == 0) and stats.verified == (step == 2)
            assert stats.ring_bytes > 0
        # A shard re-allocated on trainer rank 1: every rank raises, naming it, and nothing moves.
        if rank == 1:
            dts["model.layers.1.mlp.up_proj.weight"]._local_tensor.data = \
                dts["model.layers.1.mlp.up_proj.weight"]._local_tensor.data.clone()
        with pytest.raises(AgreementError, match=r"trainer rank 1 refused.*model\.layers\.1\.mlp\.up_proj.*re-allocated"):
            sender.send()
        # send(replan=True) on every trainer rank: planned again, and the receiver keeps its plan (same stream)
        _update(dts, _full_state(7), rank)
        stats = sender.send(replan=True, verify=True)
        assert stats.planned == (rank == 1)  # only the rank whose shard moved plans again
        with pytest.raises(AgreementError, match=r"refit rank 1 refused: tensor 'lm_head.weight' on rank 1 was re-allocated"):
            sender.send()
    elif rank == ENGINE:
        # nn.Parameters that require grad, as an engine's module holds them
        dest = {k: nn.Parameter(torch.full(v.shape, 3, dtype=_wire(v).dtype), requires_grad=v.is_floating_point())
                for k, v in state.items()}
        receiver = RefitReceiver(refit, tensors=dest, ring_depth=2)
        for step in range(3):
            stats = receiver.receive()
            assert stats.planned == (step == 0) and stats.verified == (step == 2)
            want = _full_state(step)
            wrong = [k for k, v in dest.items() if not same_bits(v.detach(), _wire(want[k]))]
            assert not wrong, f"step {step}: {wrong}"
        before = {k: v.detach().clone() for k, v in dest.items()}
        with pytest.raises(AgreementError, match=r"trainer rank 1 refused.*model\.layers\.1\.mlp\.up_proj.*re-allocated"):
            receiver.receive()
        assert all(same_bits(v.detach(), before[k]) for k, v in dest.items()), "a refused refit wrote something"
        stats = receiver.receive()
        assert not stats.planned and stats.verified
        want = _full_state(7)
        assert all(same_bits(v.detach(), _wire(want[k])) for k, v in dest.items())
        # A parameter re-allocated on the engine (.data assigned): refused on every rank, naming it.
        dest["lm_head.weight"].data = dest["lm_head.weight"].data.clone()
        with pytest.raises(AgreementError, match=r"refit rank 1 refused: tensor 'lm_head.weight' on rank 1 was re-allocated"):
            receiver.receive()
    dist.barrier()


@pytest.mark.parametrize("stateless", [False, True], ids=["new_group", "own_store"])
def test_refit_inplace_bitwise_kept_plan(stateless):
    run_ranks(3, _inplace_body, stateless, timeout=180)


class _Engine(nn.Module):
    """Parameters fused the way vLLM fuses them (qkv_proj, gate_up_proj), in bf16, with a load_weights that
    takes (name, tensor) pairs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(37, H, dtype=torch.bfloat16))
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.qkv_proj = nn.Parameter(torch.zeros(H + 2 * KV, H, dtype=torch.bfloat16))
            layer.o_proj = nn.Parameter(torch.zeros(H, H, dtype=torch.bfloat16))
            layer.gate_up_proj = nn.Parameter(torch.zeros(2 * FF, H, dtype=torch.bfloat16))
            layer.down_proj = nn.Parameter(torch.zeros(H, FF, dtype=torch.bfloat16))
            layer.norm = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16))
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16))
        self.lm_head = nn.Parameter(torch.zeros(VOCAB, H, dtype=torch.bfloat16))
        self.register_buffer("step", torch.zeros(2, dtype=torch.int64))

    # (engine name, rows) per stacked shard: where q, k, v and gate, up go in the fused tensors
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", H), "v_proj": ("qkv_proj", H + KV),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", FF)}

    def target(self, name: str) -> tuple[torch.Tensor, int]:
        if name.startswith("layers."):
            i, short = name.split(".")[1], name.split(".")[2]
            if short in self._STACKED:
                fused, row = self._STACKED[short]
                return getattr(self.layers[int(i)], fused), row
            return getattr(self.layers[int(i)], short), 0
        return {"embed": self.embed, "norm": self.norm, "lm_head": self.lm_head, "step": self.step}[name], 0

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        for name, t in weights:
            dst, row = self.target(name)
            dst[row:row + t.shape[0]].copy_(t)

    @torch.no_grad()
    def load_piece(self, name: str, flat: torch.Tensor, first: int) -> None:
        dst, row = self.target(name)
        dst.view(-1)[row * dst.shape[-1] + first:][:flat.numel()].copy_(flat)


def _engine_name(name: str):
    """The sender's Hugging Face names as the engine's, or None for what the engine does not take."""
    name = name.removeprefix("model.")
    for a, b in (("embed_tokens.weight", "embed"), ("self_attn.", ""), ("mlp.", ""), (".weight", ""),
                 ("input_layernorm", "norm")):
        name = name.replace(a, b)
    return None if name == "odd" else name


def _callback_body(rank, world_size):
    trainer, refit = _groups(rank, stateless=False)
    if rank in TRAINER:
        mesh = DeviceMesh.from_group(trainer, "cpu")
        dts = _as_dtensors(_full_state(0), mesh, rank)
        sender = RefitSender(dts, refit if rank == TRAINER[0] else None, dtype=torch.bfloat16, bucket_bytes=4096)
        for step in range(2):
            _update(dts, _full_state(step), rank)
            sender.send(verify=True)
    elif rank == ENGINE:
        engine = _Engine()
        calls, pieces = [], []

        def on_weights(batch):
            named = [(_engine_name(n), t) for n, t in batch]
            engine.load_weights([(n, t) for n, t in named if n is not None])
            for name, flat, first, shape in batch.pieces:
                assert name == "lm_head.weight" and tuple(shape) == (VOCAB, H) and flat.dim() == 1
                pieces.append((first, flat.numel()))
                engine.load_piece(_engine_name(name), flat, first)
            calls.append(len(batch))

        receiver = RefitReceiver(refit, on_weights=on_weights)
        for step in range(2):
            calls.clear()
            pieces.clear()
            stats = receiver.receive()
            assert stats.verified and stats.buckets == len(calls) > 1
            # lm_head came in pieces that tile it exactly
            assert sorted(pieces)[0][0] == 0 and sum(n for _, n in pieces) == VOCAB * H
            want = {k: _wire(v) for k, v in _full_state(step).items()}
            for i in range(2):
                p = f"model.layers.{i}."
                layer = engine.layers[i]
                qkv = torch.cat([want[p + "self_attn.q_proj.weight"], want[p + "self_attn.k_proj.weight"],
                                 want[p + "self_attn.v_proj.weight"]])
                gate_up = torch.cat([want[p + "mlp.gate_proj.weight"], want[p + "mlp.up_proj.weight"]])
                assert same_bits(layer.qkv_proj.data, qkv) and same_bits(layer.gate_up_proj.data, gate_up)
                assert same_bits(layer.down_proj.data, want[p + "mlp.down_proj.weight"])
            assert same_bits(engine.lm_head.data, want["lm_head.weight"])
            assert same_bits(engine.embed.data, want["model.embed_tokens.weight"])
            assert same_bits(engine.step, want["model.step"])
    dist.barrier()


def test_refit_callback_fused_engine_with_name_map():
    run_ranks(3, _callback_body, timeout=180)


def _engine_refuses_body(rank, world_size):
    trainer, refit = _groups(rank, stateless=False)
    state = _full_state(0)
    if rank in TRAINER:
        dts = _as_dtensors(state, DeviceMesh.from_group(trainer, "cpu"), rank)
        sender = RefitSender(dts, refit if rank == TRAINER[0] else None, bucket_bytes=4096)
        with pytest.raises(AgreementError, match=r"refit rank 1 refused.*'model\.norm\.weight'.*\[16\].*\[17\]"):
            sender.send()
    elif rank == ENGINE:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        dest["model.norm.weight"] = torch.zeros(17)
        with pytest.raises(AgreementError, match=r"refit rank 1 refused.*'model\.norm\.weight'.*\[16\].*\[17\]"):
            RefitReceiver(refit, tensors=dest).receive()
        assert all(not v.any() for v in dest.values()), "a refused refit wrote something"
    dist.barrier()


def test_refit_engine_shape_mismatch_raises_on_every_rank():
    run_ranks(3, _engine_refuses_body, timeout=180)


def _unsharded_body(rank, world_size):
    """A trainer of one rank holding plain tensors (no DTensor, no trainer group), to two engines."""
    refit = dist.new_group([0, 1, 2])
    state = _full_state(3)
    if rank == 0:
        sender = RefitSender(state, refit, bucket_bytes=4096)
        assert sender.send(verify=True).bytes == sum(v.numel() * v.element_size() for v in state.values())
    else:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        RefitReceiver(refit, tensors=dest).receive()
        assert all(same_bits(v, state[k]) for k, v in dest.items())
    dist.barrier()


def test_refit_unsharded_sender_two_engines():
    run_ranks(3, _unsharded_body, timeout=120)


def _in_one_buffer(state: dict) -> dict:
    """The same tensors as views of one byte buffer, each at a 16-byte boundary in state order: the byte
    stream's own layout, so a bucket's bytes lie back to back there unless a tensor's size leaves padding."""
    offsets, off = [], 0
    for v in state.values():
        offsets.append(off)
        off = (off + v.numel() * v.element_size() + 15) // 16 * 16
    flat = torch.zeros(off, dtype=torch.uint8)
    out = {}
    for (k, v), o in zip(state.items(), offsets):
        n = v.numel() * v.element_size()
        out[k] = flat[o:o + n].view(v.dtype).view(v.shape)
        out[k].copy_(v)
    return out


def _direct_body(rank, world_size, direct):
    """Direct buckets: a bucket whose bytes lie back to back in one storage on a rank is sent from or
    received into that memory (no slot, no copy there), decided by each rank alone. The sender and engine 1
    hold the state in one buffer (every bucket direct but those with padding: model.odd is 60 bytes),
    engine 2 as separate tensors (direct only where a bucket lies inside one tensor: lm_head spans several).
    direct=False: every bucket through the ring on every rank."""
    refit = dist.new_group([0, 1, 2])
    state = _full_state(3)
    if rank == 0:
        mine = _in_one_buffer(state)
        side = RefitSender(mine, refit, bucket_bytes=4096, direct=direct)
    else:
        mine = _in_one_buffer({k: torch.zeros_like(v) for k, v in state.items()}) if rank == 1 else \
            {k: torch.zeros_like(v) for k, v in state.items()}
        side = RefitReceiver(refit, tensors=mine, direct=direct)
    for step in (3, 4):  # the second run reuses the plans
        if rank == 0 and step == 4:
            for k, v in _full_state(4).items():
                mine[k].copy_(v)
        stats = side.send(verify=True) if rank == 0 else side.receive()
        assert stats.planned is (step == 3)
        if rank > 0:
            assert all(same_bits(v, _full_state(step)[k]) for k, v in mine.items()), (rank, step)
        counts = [None] * 3
        dist.all_gather_object(counts, (stats.direct_buckets, stats.buckets))
        if not direct:
            assert all(d == 0 for d, _ in counts), counts
            continue
        (d0, n), (d1, _), (d2, _) = counts
        assert 0 < d0 < n and d1 == d0, counts  # the same layout: the same buckets direct on both
        assert 3 <= d2 < d1, counts  # lm_head's inner buckets
    dist.barrier()


@pytest.mark.parametrize("direct", [True, False])
def test_refit_direct_buckets_one_buffer_bitwise(direct):
    run_ranks(3, _direct_body, direct, timeout=120)


@pytest.mark.skipif(not hasattr(__import__("torch.distributed.fsdp").distributed.fsdp, "fully_shard"),
                    reason="the example trainer uses FSDP2's public fully_shard (torch >= 2.6)")
@pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                    reason="FSDP2 trains on the CPU from torch 2.7 (torch 2.6's torch.cpu.Stream has no record_event, "
                           "which its all-gather calls)")
def test_examples_trainer_and_engine_on_cpu():
    """examples/refit_trainer.py (torchrun, 2 ranks, FSDP2) and examples/refit_engine.py (its own process,
    fused parameters) as the README runs them, on the CPU: every refit arrives and the last is verified."""
    import os
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    # PYTHONFAULTHANDLER: a process that aborts prints every thread's Python stack (where it was).
    env = dict(os.environ, PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                os.path.join(root, "examples", "refit_trainer.py"), "--cpu", "--port", port],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        engine = subprocess.run([sys.executable, os.path.join(root, "examples", "refit_engine.py"), "--device", "cpu",
                                 "--port", port], env=env, capture_output=True, text=True, timeout=240)
        out, _ = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    assert engine.returncode == 0 and trainer.returncode == 0, engine.stderr[-3000:] + out[-3000:]
    assert "step 2: 34 tensors" in engine.stderr and "verified" in engine.stderr, engine.stderr[-2000:]


def _trainer_refuses_body(rank, world_size):
    """Trainer rank 1 holds something that is not a tensor under one name: every rank raises, naming it."""
    trainer, refit = _groups(rank, stateless=False)
    state = _full_state(0)
    pattern = r"trainer rank 1 refused: tensor 3 \('model\.layers\.0\.self_attn\.v_proj\.weight'\) is a list"
    if rank in TRAINER:
        items = list(_as_dtensors(state, DeviceMesh.from_group(trainer, "cpu"), rank).items())
        if rank == 1:
            items[3] = (items[3][0], [1.0, 2.0])
        with pytest.raises(AgreementError, match=pattern):
            RefitSender(items, refit if rank == TRAINER[0] else None, bucket_bytes=4096).send()
    elif rank == ENGINE:
        with pytest.raises(AgreementError, match=pattern):
            RefitReceiver(refit, tensors={k: torch.zeros_like(v) for k, v in state.items()}).receive()
    dist.barrier()


def test_refit_trainer_rank_refusal_raises_on_every_rank():
    run_ranks(3, _trainer_refuses_body, timeout=120)


def _replicated_trainer_body(rank, world_size, sender_rank, as_dtensor):
    refit = dist.new_group([TRAINER[0], ENGINE])
    trainer = dist.new_group(list(TRAINER))
    state = _full_state(3)
    if rank in TRAINER:
        if as_dtensor:  # replicated DTensors: nothing sharded, so no trainer group is derived from them
            mesh = DeviceMesh.from_group(trainer, "cpu")
            weights = {k: DTensor.from_local(v.clone(), mesh, [Replicate()], run_check=False) for k, v in state.items()}
        else:  # a DDP-style trainer: every rank holds the whole state as plain tensors
            weights = {k: v.clone() for k, v in state.items()}
        # Only trainer rank 0 is in the refit group: it sends, whatever sender_rank says, and rank 1 sits out.
        sender = RefitSender(weights, refit if rank == TRAINER[0] else None, sender_rank=sender_rank, bucket_bytes=4096)
        for _ in range(2):
            stats = sender.send(verify=True)
            assert stats.bytes > 0 if rank == TRAINER[0] else (stats.bytes == 0 and stats.buckets == 0), stats
    else:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        receiver = RefitReceiver(refit, tensors=dest)
        for _ in range(2):
            receiver.receive()
        for k, v in state.items():
            assert same_bits(dest[k], v), k


@pytest.mark.parametrize("sender_rank", [0, 1])
@pytest.mark.parametrize("as_dtensor", [False, True], ids=["plain", "replicated"])
def test_refit_unsharded_trainer_of_two_ranks_sends_from_the_rank_in_the_refit_group(sender_rank, as_dtensor):
    """Every trainer rank makes a RefitSender; with nothing sharded, the rank given the refit group sends and
    the other does nothing (before: each took itself for the only trainer rank, and with sender_rank 0 rank 1
    failed for want of a refit group, with 1 nobody sent and the engine waited)."""
    run_ranks(3, _replicated_trainer_body, sender_rank, as_dtensor, timeout=120)


def _callback_name_map_body(rank, world_size):
    pg = dist.new_group([0, 1])
    state = {"model.a.weight": torch.arange(6.).reshape(2, 3), "model.skip": torch.ones(3),
             "model.big": torch.arange(3000.),  # 12,000 bytes: pieces over several 4 KiB buckets
             "model.none": torch.empty(0, 5, dtype=torch.bfloat16), "model.none_skipped": torch.empty(0)}
    if rank == 0:
        RefitSender(state, pg, bucket_bytes=4096).send()
        return
    pairs, pieces = [], []

    def take(batch):
        pairs.extend((name, t.clone()) for name, t in batch)
        pieces.extend((name, flat.clone(), first, shape) for name, flat, first, shape in batch.pieces)

    names = {"model.a.weight": "a", "model.skip": None, "model.none_skipped": None}
    RefitReceiver(pg, on_weights=take, name_map=lambda n: names.get(n, n.replace("model.", "")),
                  ).receive()
    # A zero-element tensor has no bytes in any bucket: it comes last, as an empty tensor of its shape.
    assert [n for n, _ in pairs] == ["a", "none"], pairs
    assert torch.equal(pairs[0][1], state["model.a.weight"])
    assert pairs[1][1].shape == (0, 5) and pairs[1][1].dtype == torch.bfloat16, pairs[1][1]
    assert {n for n, *_ in pieces} == {"big"}, [p[0] for p in pieces]
    big = torch.cat([flat for _, flat, _, _ in sorted(pieces, key=lambda p: p[2])])
    assert torch.equal(big, state["model.big"])


def test_refit_callback_gets_the_mapped_names():
    """name_map applies to on_weights too: a callback gets this side's names, and names mapped to None are
    left out of its batches (before, it got the sender's names and every tensor); zero-element tensors reach
    it too (before, they never did)."""
    run_ranks(2, _callback_name_map_body, timeout=120)


def _replaced_parameter_body(rank, world_size):
    pg = dist.new_group([0, 1])
    if rank == 0:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        sender = RefitSender(model, pg, bucket_bytes=4096)
        assert sender.names == ["0.weight", "0.bias", "1.weight", "1.bias"], sender.names
        sender.send(verify=True)
        # A rollback that assigns new tensors: the plan's storage is no longer the model's.
        new = {k: torch.full_like(v, 2.0) for k, v in model.state_dict().items()}
        model.load_state_dict(new, assign=True)
        with pytest.raises(AgreementError, match="'0.weight'.*replaced by another object"):
            sender.send()
        stats = sender.send(replan=True, verify=True)
        assert stats.planned, stats
        sender.send(verify=True)  # the new plan is kept
        # Two names mapped to one engine tensor: refused before any byte moves.
        with pytest.raises(AgreementError, match="both map to 'w'"):
            sender.send()
    else:
        dest = {"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3), "1.weight": torch.zeros(2, 3),
                "1.bias": torch.zeros(2)}
        receiver = RefitReceiver(pg, tensors=dest)
        receiver.receive()
        with pytest.raises(AgreementError, match="replaced by another object"):
            receiver.receive()
        receiver.receive()
        assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in dest.values()), dest
        receiver.receive()
        clash = RefitReceiver(pg, tensors={"w": torch.zeros(3, 4), "1.weight": torch.zeros(2, 3),
                                           "1.bias": torch.zeros(2)},
                              name_map={"0.weight": "w", "0.bias": "w"})
        with pytest.raises(AgreementError, match="both map to 'w'"):
            clash.receive()


def test_refit_sender_of_a_module_refuses_replaced_parameters():
    """A RefitSender made from a module checks on every send that each parameter is still the object planned
    with (before: after load_state_dict(assign=True) it sent the old storage, and verify passed); a receiver
    whose name_map sends two names to one tensor is refused at planning."""
    run_ranks(2, _replaced_parameter_body, timeout=120)

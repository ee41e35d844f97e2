"""load_full_state_dict on CPU over gloo: plain modules, FSDP2 (fully_shard on a CPU mesh) and DTensors
built directly, on 2 and 3 ranks, each checked bitwise against load_state_dict of the same state on one
process. Each world size is one spawned run that goes through every case (spawning costs ~10 s)."""
from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    HAVE_FSDP2 = True
except ImportError:  # torch < 2.6: FSDP2 only under a private name, and there it needs CUDA (2.4: CUDA streams)
    HAVE_FSDP2 = False

    class DTensor:  # noqa: D101 - nothing is one here
        pass

needs_fsdp2 = pytest.mark.skipif(not HAVE_FSDP2, reason="this torch has no public FSDP2 (torch.distributed.fsdp."
                                 "fully_shard, torch >= 2.6): the FSDP2 and DTensor loads cannot run on CPU here")

from dist_utils import run_ranks
from zoo import bits, fill_random_bytes, same_bits

import coalesced_bcast
from coalesced_bcast._load_plan import _idle_fsdp_hook
from coalesced_bcast.state_dict import LoadStateDictError, load_full_state_dict

SMALL = dict(bucket_bytes=4096)  # most tensors span several buckets


class Net(nn.Module):
    """Uneven dim 0 everywhere, buffers (int, bool, 0-dim, one non-persistent), tied embedding/head."""

    def __init__(self, vocab: int = 11, hidden: int = 6, rows: int = 1500) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.l1 = nn.Linear(hidden, 7)
        self.l2 = nn.Linear(7, 3, bias=False)
        self.bn = nn.BatchNorm1d(3)  # running stats and an int64 0-dim num_batches_tracked
        self.big = nn.Parameter(torch.empty(rows, 3))  # 18 kB: larger than a 4 kB bucket
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.ones(5, dtype=torch.bool))
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(self.emb(x)))


class Odd(nn.Module):
    """Plain-module extras: a non-contiguous parameter, complex, fp8, an extra state and a post-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.empty(9, 4).t())
        self.c = nn.Parameter(torch.empty(3, 2, dtype=torch.complex64))
        self.register_buffer("f8", torch.empty(33, dtype=torch.float8_e4m3fn))
        self.scalar = nn.Parameter(torch.empty((), dtype=torch.float64))
        self.extra = {"step": -1}
        self.post_hook_calls = 0
        self.register_load_state_dict_post_hook(lambda m, keys: setattr(m, "post_hook_calls", m.post_hook_calls + 1))

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = dict(state)


def random_sd(model: nn.Module, seed: int, dtype: torch.dtype | None = None, tie: bool = True) -> dict:
    """Random bytes (NaN payloads and all) for every key, the same on every rank for one seed.

    With tie, keys that share a tensor in the model share one in the state dict, as torch.save keeps them.
    """
    gen = torch.Generator().manual_seed(seed)
    out, by_id = {}, {}
    for k, v in model.state_dict(keep_vars=True).items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        if tie and id(v) in by_id:
            out[k] = by_id[id(v)]
            continue
        dt = dtype if dtype is not None and v.is_floating_point() else v.dtype
        t = torch.empty(tuple(v.shape), dtype=dt)
        fill_random_bytes(t, gen)
        out[k] = by_id[id(v)] = t
    return out


def fill_sentinel(model: nn.Module) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local = t._local_tensor if isinstance(t, DTensor) else t
            bits(local.detach()).fill_(7)


def snapshot(model: nn.Module) -> dict:
    out = {}
    for k, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        local = t._local_tensor if isinstance(t, DTensor) else t
        out[k] = local.detach().clone()
    return out


def assert_same_as_reference(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Every state-dict key bitwise equal to the one-process reference (DTensors via full_tensor())."""
    ref_sd = ref.state_dict()
    got = model.state_dict()
    assert list(got) == list(ref_sd), f"{what}: keys differ"
    for k, r in ref_sd.items():
        g = got[k]
        if isinstance(r, torch.Tensor):
            g = g.full_tensor() if isinstance(g, DTensor) else g
            assert same_bits(g, r), f"{what}: '{k}' differs from load_state_dict on rank {dist.get_rank()}"
        else:
            assert g == r, f"{what}: extra state '{k}': {g} != {r}"


def expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except LoadStateDictError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"rank {dist.get_rank()}: {n!r} not in error: {msg}"
        return msg
    raise AssertionError(f"rank {dist.get_rank()}: no LoadStateDictError; wanted one with {needles}")


def build_plain(rank: int, cls=Net, **kw) -> nn.Module:
    """Rank 0 builds for real; the others on meta then to_empty, which unties the tied weights."""
    if rank == 0:
        return cls(**kw)
    with torch.device("meta"):
        m = cls(**kw)
    return m.to_empty(device="cpu")


def build_fsdp2(mesh, dtype: torch.dtype | None = None, **kw) -> nn.Module:
    with torch.device("meta"):
        m = Net(**kw)
    if dtype is not None:
        m = m.to(dtype)
    fully_shard(m.l1, mesh=mesh)
    fully_shard(m.l2, mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.to_empty(device="cpu")
    fill_sentinel(m)
    return m


def reference(cls, sd: dict, dtype: torch.dtype | None = None, **kw) -> nn.Module:
    ref = cls(**kw)
    if dtype is not None:
        ref = ref.to(dtype)
    ref.load_state_dict(sd)
    return ref


class DT(nn.Module):
    """DTensor parameters built directly: Shard(1), Replicate, and a 2-D mesh (compute_local_shape path)."""

    def __init__(self, mesh1, mesh2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.s1 = nn.Parameter(distribute_tensor(torch.randn(3, 10, 2, generator=g), mesh1, [Shard(1)]))
        self.rep = nn.Parameter(distribute_tensor(torch.randn(4, 5, generator=g), mesh1, [Replicate()]))
        self.m2 = nn.Parameter(distribute_tensor(torch.randn(13, 3, generator=g), mesh2, [Replicate(), Shard(0)]))


def check_plain(rank: int, ws: int) -> None:
    # Tied on the source, untied elsewhere (to_empty); shared tensors in the checkpoint; tiny buckets.
    sd = random_sd(Net(), seed=1)
    model = build_plain(rank)
    fill_sentinel(model)
    inv_freq = model.inv_freq.clone()
    stats = load_full_state_dict(model, sd if rank == 0 else None, src=0, **SMALL)
    assert_same_as_reference(model, reference(Net, sd), "plain")
    assert same_bits(model.inv_freq, inv_freq), "a non-persistent buffer was written"
    n_unique = len({id(v) for v in sd.values()})
    assert stats.tensors == n_unique and stats.keys == len(sd), stats
    assert stats.bytes == sum(v.numel() * v.element_size() for v in {id(v): v for v in sd.values()}.values())
    assert stats.buckets > 4 and stats.cast_keys == 0, stats
    assert stats.ring_bytes == coalesced_bcast.DEFAULT_RING_DEPTH * 4096, stats
    if rank == 0:
        assert model.head.weight is model.emb.weight

    # The same keys in another order (matched key by key; in the model's order they are taken as they come).
    shuffled = random_sd(Net(), seed=7)
    shuffled = dict(reversed(list(shuffled.items())))
    fill_sentinel(model)
    load_full_state_dict(model, shuffled if rank == 0 else None, src=0, **SMALL)
    assert_same_as_reference(model, reference(Net, shuffled), "plain, keys in another order")

    # Two different tensors for tied keys: the last key wins, as with load_state_dict; ring_depth 1.
    sd = random_sd(Net(), seed=2, tie=False)
    fill_sentinel(model)
    load_full_state_dict(model, sd if rank == 0 else None, src=0, ring_depth=1, **SMALL)
    ref = reference(Net, sd)
    if rank == 0:
        assert_same_as_reference(model, ref, "plain, untied checkpoint")
    else:  # untied here: each name holds its own key's value
        assert same_bits(model.emb.weight, sd["emb.weight"]) and same_bits(model.head.weight, sd["head.weight"])

    # Checkpoint from torch.load(mmap=True), non-contiguous source tensors, a float32->float64 cast,
    # complex and fp8 tensors, an extra state, a non-contiguous destination and a post-hook.
    sd = random_sd(Odd(), seed=3)
    sd["t"] = sd["t"].t().contiguous().t()  # the same values through transposed strides
    sd["scalar"] = sd["scalar"].float()
    sd["_extra_state"] = {"step": 41}
    odd = build_plain(rank, Odd)
    fill_sentinel(odd)
    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            torch.save(sd, os.path.join(d, "sd.pt"))
            loaded = torch.load(os.path.join(d, "sd.pt"), mmap=True, weights_only=True)
            assert not loaded["t"].is_contiguous()
        stats = load_full_state_dict(odd, loaded if rank == 0 else None, src=0, **SMALL)
    ref = Odd()
    ref.load_state_dict(sd)
    assert stats.cast_keys == 1, stats
    assert odd.extra == {"step": 41}, odd.extra
    for k in ("t", "c", "f8", "scalar"):
        assert same_bits(getattr(odd, k), getattr(ref, k)), f"Odd.{k} on rank {rank}"
    assert not odd.t.is_contiguous() and odd.post_hook_calls == 1

    # Expanded (stride-0) source tensors, as torch.save keeps them: read through their strides, as
    # load_state_dict's copy_ reads them (before, refused as overlapping themselves).
    sd = random_sd(Odd(), seed=5)
    sd["t"] = sd["t"][:, :1].expand(4, 9)
    sd["f8"] = sd["f8"][:1].expand(33)
    load_full_state_dict(odd, sd if rank == 0 else None, src=0, **SMALL)
    ref.load_state_dict(sd)
    for k in ("t", "c", "f8", "scalar"):
        assert same_bits(getattr(odd, k), getattr(ref, k)), f"expanded source: Odd.{k} on rank {rank}"

    # Several copy threads on a bucket large enough to split, and the progress log.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("coalesced_bcast")  # the load's modules log under the package's name
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    big_sd = random_sd(Net(rows=1_000_000), seed=4)
    big = build_plain(rank, rows=1_000_000)
    load_full_state_dict(big, big_sd if rank == 0 else None, src=0, bucket_bytes=2 << 20, copy_threads=4,
                         progress_seconds=0.0)
    log.removeHandler(handler)
    assert_same_as_reference(big, reference(Net, big_sd, rows=1_000_000), "threads")
    if rank == 0:
        assert any("ETA" in r.getMessage() for r in records), [r.getMessage() for r in records]


def check_errors(rank: int, ws: int) -> None:
    sd = random_sd(Net(), seed=6)
    model = build_plain(rank)
    fill_sentinel(model)
    before = snapshot(model)

    def unchanged(what: str) -> None:
        after = snapshot(model)
        assert all(same_bits(before[k], after[k]) for k in before), f"{what}: a tensor was written on rank {rank}"

    bad = dict(sd)
    del bad["l1.bias"]
    bad["extra.weight"] = torch.zeros(2)
    expect_error(lambda: load_full_state_dict(model, bad if rank == 0 else None, **SMALL),
                 'Missing key(s) in state_dict: "l1.bias"', 'Unexpected key(s) in state_dict: "extra.weight"')
    unchanged("strict")
    stats = load_full_state_dict(model, bad if rank == 0 else None, strict=False, **SMALL)
    assert stats.missing_keys == ("l1.bias",) and stats.unexpected_keys == ("extra.weight",), stats
    assert same_bits(model.l1.bias, before["l1.bias"]) and same_bits(model.l1.weight, sd["l1.weight"])
    fill_sentinel(model)
    before = snapshot(model)

    shape = dict(sd, **{"l2.weight": torch.zeros(3, 8)})
    expect_error(lambda: load_full_state_dict(model, shape if rank == 0 else None, strict=False, **SMALL),
                 "size mismatch for l2.weight", "torch.Size([3, 8])", "torch.Size([3, 7])")
    value = dict(sd, **{"l1.bias": "oops"})
    expect_error(lambda: load_full_state_dict(model, value if rank == 0 else None, **SMALL), '"l1.bias"', "str")
    expect_error(lambda: load_full_state_dict(model, None, **SMALL), "source rank 0", "sd is None")
    odd_key = dict(sd)
    odd_key[7] = torch.zeros(1)
    expect_error(lambda: load_full_state_dict(model, odd_key if rank == 0 else None, **SMALL), "not a string: 7")
    expect_error(lambda: load_full_state_dict(model, sd if rank == 1 else None, src=1, bucket_bytes=4096 + 16 * rank),
                 "bucket_bytes")
    if rank == ws - 1:
        with torch.device("meta"):
            unmade = Net()
    else:
        unmade = model
    expect_error(lambda: load_full_state_dict(unmade, sd if rank == 0 else None, **SMALL),
                 "'big' is on the meta device", "to_empty")
    # One tensor left on meta past the first (the device comes from the first; each loaded one is checked):
    # named, refused on every rank, nothing written anywhere.
    half = build_plain(rank)
    if rank == ws - 1:
        half.l1.bias = nn.Parameter(torch.empty(7, device="meta"))
    half_before = snapshot(half)
    expect_error(lambda: load_full_state_dict(half, sd if rank == 0 else None, **SMALL), f"rank {ws - 1}",
                 '"l1.bias" is on the meta device', "to_empty")
    assert all(same_bits(half_before[k], v) for k, v in snapshot(half).items() if not v.is_meta), f"rank {rank}: written"
    unchanged("errors")

    # A model that differs on one rank: strict names the key there, non-strict still refuses everywhere.
    other = build_plain(rank)
    if rank == ws - 1:
        other.l3 = nn.Linear(2, 2)
    expect_error(lambda: load_full_state_dict(other, sd if rank == 0 else None, **SMALL), f"rank {ws - 1}",
                 '"l3.weight"')
    sd3 = dict(sd, **{"l3.weight": torch.zeros(2, 2), "l3.bias": torch.zeros(2)})
    expect_error(lambda: load_full_state_dict(other, sd3 if rank == 0 else None, strict=False, **SMALL),
                 "the models differ")


def _judged_in_steps(model: nn.Module, count: int, times: int) -> list:
    """HookJudgment's answers, `count` hooks a step, `times` steps; then its verdict, which must be the last."""
    judgment = coalesced_bcast._C.HookJudgment(model)
    steps = [judgment.step(count) for _ in range(times)]
    assert judgment.verdict() is steps[-1]
    return steps


def _replace_dtensor_param(m: nn.Module, name: str, mesh) -> torch.Tensor:
    """m.name replaced by a new Shard(0) DTensor parameter of the same shape, its shard not in FSDP2's padded
    storage (so that FSDP2's post-hook for it has work to do); the one replaced."""
    w = getattr(m, name)
    setattr(m, name, nn.Parameter(DTensor.from_local(torch.empty_like(w._local_tensor), mesh, [Shard(0)],
                                                     run_check=False, shape=w.shape, stride=w.stride())))
    return w


def check_fsdp2(rank: int, ws: int) -> None:
    mesh = init_device_mesh("cpu", (ws,))
    vocab = ws * 4 + 1  # uneven rows, and with 3 ranks l2's 3 rows give one row each
    sd = random_sd(Net(vocab=vocab), seed=7)
    model = build_fsdp2(mesh, vocab=vocab)
    assert isinstance(model.l1.weight, DTensor) and model.l1.weight.placements == (Shard(0),)
    stats = load_full_state_dict(model, sd if rank == 0 else None, **SMALL)
    ref = reference(Net, sd, vocab=vocab)
    assert_same_as_reference(model, ref, "fsdp2")
    assert stats.ring_bytes == coalesced_bcast.DEFAULT_RING_DEPTH * 4096
    # FSDP2's post-hooks (one per parameter, re-padding a replaced shard) would do nothing after an in-place
    # load: every one is passed over.
    hooks = [(m, h) for m in model.modules() for h in m._load_state_dict_post_hooks.values()]
    assert len(hooks) == len(list(model.parameters())) and all(_idle_fsdp_hook(m, h) for m, h in hooks)
    assert coalesced_bcast._C.post_hooks_idle(model)  # the one C++ walk that passes over them all
    handle = model.l2.register_load_state_dict_post_hook(lambda m, keys: None)  # not FSDP2's: must run
    assert not coalesced_bcast._C.post_hooks_idle(model)
    steps = _judged_in_steps(model, 1, len(hooks) + 3)  # as while a GPU load's plan is made
    first = steps.index(False)
    assert steps == [None] * first + [False] * (len(steps) - first), steps
    handle.remove()
    assert coalesced_bcast._C.post_hooks_idle(model)
    # A shard moved within FSDP2's padded storage (the same storage, another first byte): its hook has work.
    fp1 = next(f for f in (h.__closure__[0].cell_contents for _, h in hooks)
               if f.sharded_param._local_tensor.size(0) > 1)
    kept = fp1.sharded_param._local_tensor
    fp1.sharded_param._local_tensor = kept[1:]
    assert not coalesced_bcast._C.post_hooks_idle(model)
    fp1.sharded_param._local_tensor = kept
    assert coalesced_bcast._C.post_hooks_idle(model)
    for count in (1, 3, len(hooks)):
        steps = _judged_in_steps(model, count, len(hooks) // count + 2)
        assert steps[-1] is True and steps.index(True) == (len(hooks) - 1) // count, (count, steps)
        assert set(steps[:steps.index(True)]) <= {None}, (count, steps)
    # A parameter replaced since fully_shard (a new DTensor, its shard not in FSDP2's padded storage): its
    # hook runs, so FSDP2 takes the new parameter and re-pads its shard, holding the loaded values.
    w = _replace_dtensor_param(model.l1, "weight", mesh)
    (fp,) = [f for f in (h.__closure__[0].cell_contents for h in model.l1._load_state_dict_post_hooks.values())
             if f._module_info.param_name == "weight"]  # the FSDPParam its hook re-pads
    assert fp.sharded_param is w
    assert sum(_idle_fsdp_hook(m, h) for m, h in hooks) == len(hooks) - 1
    assert not coalesced_bcast._C.post_hooks_idle(model)
    fill_sentinel(model)
    load_full_state_dict(model, sd if rank == 0 else None, **SMALL)
    assert fp.sharded_param is model.l1.weight
    assert fp._sharded_param_data.data_ptr() == model.l1.weight._local_tensor.data_ptr()
    assert_same_as_reference(model, ref, "fsdp2, a parameter replaced")
    # FSDP2's lazy init re-pads the shards on the first forward: the loaded values must survive it. Torch
    # 2.6's FSDP2 runs no forward on the CPU (its all-gather records an event on a torch.cpu.Stream, which
    # has no record_event before 2.7): there the load is checked without it.
    if hasattr(torch.cpu.Stream, "record_event"):
        model.train(False)
        model(torch.arange(vocab))
        assert_same_as_reference(model, ref, "fsdp2 after a forward")

    # float32 checkpoint into a bfloat16 model: cast on arrival, bitwise as load_state_dict casts.
    model = build_fsdp2(mesh, dtype=torch.bfloat16, vocab=vocab)
    stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=8192, ring_depth=2)
    n_float = sum(1 for k, v in Net(vocab=vocab).state_dict().items() if v.is_floating_point())
    assert stats.cast_keys == n_float and stats.bytes == sum(
        v.numel() * v.element_size() for v in {id(v): v for v in sd.values()}.values()), stats
    assert_same_as_reference(model, reference(Net, sd, dtype=torch.bfloat16, vocab=vocab), "fsdp2 bf16")

    # DTensors made directly: Shard(1), Replicate, Replicate x Shard(0) on a 2-D mesh.
    mesh2 = init_device_mesh("cpu", (1, ws))
    dt = DT(mesh, mesh2)
    fill_sentinel(dt)
    sd_dt = random_sd(DT(mesh, mesh2), seed=8)
    load_full_state_dict(dt, sd_dt if rank == 0 else None, bucket_bytes=4096)
    for k, v in dt.state_dict().items():
        assert same_bits(v.full_tensor(), sd_dt[k]), f"DTensor '{k}' on rank {rank}"
    expect_error(lambda: load_full_state_dict(dt, dt.state_dict() if rank == 0 else None), "DTensor")


class Block(nn.Module):
    """One parameter (a DTensor under fully_shard: uneven, on 3 ranks often empty on some) and one plain buffer."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty((i % 5, 3) if i % 2 else (i % 7,)))
        self.register_buffer("b", torch.empty(i % 4 + 1, dtype=torch.int32))


class Blocks(nn.Module):
    def __init__(self, n: int = 117) -> None:  # 234 keys: 14 groups and a part
        super().__init__()
        self.blocks = nn.ModuleList([Block(i) for i in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _RecordFed:
    """The fed plans (csrc/dest_feed.h) the loads inside make, kept to ask afterwards whether each was used."""

    def __enter__(self) -> list:
        from coalesced_bcast import _C
        self.real, self.made = _C.start_fed_load_plan, []

        def record(*args):
            self.made.append(self.real(*args))
            return self.made[-1]
        _C.start_fed_load_plan = record
        return self.made

    def __exit__(self, *exc) -> None:
        from coalesced_bcast import _C
        _C.start_fed_load_plan = self.real


def check_many_keys(rank: int, ws: int) -> None:
    """More keys than load_dests reads ahead (groups of 16, several groups deep), DTensors and plain buffers
    alternating: every key lands bitwise, through the plan fed by load_dests as it reads (also with the
    checkpoint's keys sorted, in another order than the model's), and a bad key late in the list is the one
    named, on every rank, the fed plan dropped. A plain model that names one buffer by two keys takes the plan
    made after load_dests, and the last key's value."""
    mesh = init_device_mesh("cpu", (ws,))

    def build() -> nn.Module:
        with torch.device("meta"):
            m = Blocks()
        fully_shard(m, mesh=mesh)
        m.to_empty(device="cpu")
        fill_sentinel(m)
        return m

    sd = random_sd(Blocks(), seed=11)
    model = build()
    with _RecordFed() as fed:
        stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    assert stats.keys == 234, stats
    assert [p.used for p in fed] == [True], rank
    assert_same_as_reference(model, reference(Blocks, sd), "many keys, fed")
    # Keys sorted as strings (a safetensors file's order: blocks.0, blocks.1, blocks.10, ...): the plan is fed
    # the table's rows in the model's order.
    model = build()
    with _RecordFed() as fed:
        load_full_state_dict(model, dict(sorted(sd.items())) if rank == 0 else None, bucket_bytes=4096)
    assert [p.used for p in fed] == [True], rank
    assert_same_as_reference(model, reference(Blocks, sd), "many keys, sorted")
    # FSDP2's post-hooks judged where a GPU load judges them, once the transfer is queued: with the fed plan
    # (made by the time load_dests returns) no judgment is begun while planning, and the hook of a parameter
    # replaced since fully_shard still runs (FSDP2 takes the new parameter, its shard re-padded, values kept).
    w = _replace_dtensor_param(model.blocks[6], "w", mesh)
    (fp,) = [h.__closure__[0].cell_contents for h in model.blocks[6]._load_state_dict_post_hooks.values()]
    assert fp.sharded_param is w
    fill_sentinel(model)
    from coalesced_bcast import _C, _load_plan
    real_judgment, begun = _C.HookJudgment, []
    _C.HookJudgment = lambda m: begun.append(m) or real_judgment(m)
    real_after = _load_plan._judge_hooks_after_transfer
    _load_plan._judge_hooks_after_transfer = lambda device: True  # a GPU load's rule, on this CPU model
    try:
        with _RecordFed() as fed:
            load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    finally:
        _load_plan._judge_hooks_after_transfer = real_after
        _C.HookJudgment = real_judgment
    assert [p.used for p in fed] == [True] and begun == [], (rank, [p.used for p in fed], len(begun))
    assert fp.sharded_param is model.blocks[6].w
    assert fp._sharded_param_data.data_ptr() == model.blocks[6].w._local_tensor.data_ptr()
    assert_same_as_reference(model, reference(Blocks, sd), "many keys, a parameter replaced, hooks after")
    model = build()
    before = snapshot(model)
    bad = dict(sd)
    bad["blocks.101.w"] = torch.zeros(4, 4)  # 101 % 5 == 1: the model's is (1, 3)
    with _RecordFed() as fed:
        expect_error(lambda: load_full_state_dict(model, bad if rank == 0 else None, bucket_bytes=4096),
                     "size mismatch for blocks.101.w", "torch.Size([4, 4])", "torch.Size([1, 3])")
    assert [p.used for p in fed] == [False]
    after = snapshot(model)
    assert all(same_bits(after[k], v) for k, v in before.items()), f"rank {rank}: a refused load wrote"

    def tied() -> nn.Module:
        m = Blocks()
        m.blocks[5].b = m.blocks[1].b  # both (2,): one tensor, two keys
        return m
    model, ref = tied(), tied()
    fill_sentinel(model)
    with _RecordFed() as fed:
        load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    assert [p.used for p in fed] == [False]
    ref.load_state_dict(sd)
    assert same_bits(model.blocks[1].b, sd["blocks.5.b"]) and same_bits(ref.blocks[1].b, sd["blocks.5.b"])
    for k, v in ref.state_dict().items():
        assert same_bits(model.state_dict()[k], v), (rank, k)


def run_all_2(rank: int, ws: int) -> None:
    check_plain(rank, ws)
    check_errors(rank, ws)
    if HAVE_FSDP2:
        check_fsdp2(rank, ws)


def run_all_3(rank: int, ws: int) -> None:
    if HAVE_FSDP2:
        check_fsdp2(rank, ws)
        check_many_keys(rank, ws)
    check_errors(rank, ws)


def test_exported() -> None:
    assert coalesced_bcast.load_full_state_dict is load_full_state_dict


def test_checkpoint_keys_cross_as_one_string_and_split_back() -> None:
    """The metadata's keys go as one NUL-joined string where that splits back into them, else as the list; every
    rank compares its model's keys with them either way (_load_keys._joined, _load_source._to_wire,
    _load_keys._same_keys)."""
    import pickle
    from coalesced_bcast._load_keys import _ModelState, _checkpoint_keys, _joined, _same_keys
    from coalesced_bcast._load_source import _from_wire, _to_wire

    def model(keys, joined):
        return _ModelState(keys, joined, [])
    for keys in ([], [""], ["", "x", ""], ["a.weight", "b.bias"], ["é.ü", "k"], ["a\0b", "c"], [7, "a"]):
        joined = _joined(keys)
        splits = all(isinstance(k, str) and "\0" not in k for k in keys)
        assert (joined is not None) == splits, (keys, joined)
        meta = dict(fatal=None, keys=list(keys), num_keys=len(keys), keys_joined=joined, rows=None, table=None,
                    canon=None)
        wire = _to_wire(meta)
        assert (wire["keys"] is None) == splits, keys  # the list stays home where the string goes
        back = _from_wire(pickle.loads(pickle.dumps(wire)))
        model_keys = model(list(keys), _joined(keys))
        assert _same_keys(back, model_keys), keys
        assert _checkpoint_keys(back) == keys, (keys, back["keys"])  # split back (or sent as it was)
        if keys:
            other = list(keys[:-1]) + ["zz"]
            assert not _same_keys(_from_wire(pickle.loads(pickle.dumps(wire))), model(other, _joined(other))), keys
            assert not _same_keys(_from_wire(pickle.loads(pickle.dumps(wire))), model(other, None)), keys
    # A key with a NUL on one side only: never equal to the keys it would join like.
    a, b = ["a\0b"], ["a", "b"]
    meta = dict(fatal=None, keys=a, num_keys=1, keys_joined=_joined(a), rows=None, table=None, canon=None)
    assert not _same_keys(_from_wire(pickle.loads(pickle.dumps(_to_wire(meta)))), model(b, _joined(b)))


def test_metadata_tables_cross_compact_and_come_back_equal() -> None:
    """The metadata's int64 tables go without trailing zero columns, and 0..n-1 columns as their length
    (_load_source._to_wire); every shape comes back equal (_from_wire)."""
    import pickle
    from coalesced_bcast._load_source import _from_wire, _to_wire

    g = torch.Generator().manual_seed(0)
    n = 16384
    sizes = torch.zeros(n, 10, dtype=torch.int64)
    sizes[:, 0], sizes[:, 1], sizes[:, 2] = 15, 1, torch.randint(1, 1 << 20, (n,), generator=g)  # 1-dim bf16
    wide = sizes.clone()
    wide[7, 1], wide[7, 2:9] = 7, torch.arange(2, 9)  # one 7-dim tensor: its columns go for every row
    ties = torch.arange(n)
    ties[5] = 3
    cases = [dict(rows=torch.arange(n), table=sizes, canon=torch.arange(n)),
             dict(rows=torch.tensor([0, 2, 5]), table=wide[:3], canon=ties[:3]),
             dict(rows=torch.arange(n), table=wide, canon=ties),
             dict(rows=torch.zeros(0, dtype=torch.int64), table=torch.zeros(0, 10, dtype=torch.int64),
                  canon=torch.zeros(0, dtype=torch.int64)),
             dict(rows=torch.arange(2), table=torch.zeros(2, 10, dtype=torch.int64), canon=torch.tensor([0, 0]))]
    for case in cases:
        meta = dict(fatal=None, keys=[], num_keys=0, keys_joined=None, **case)
        blob = pickle.dumps(_to_wire(meta), protocol=pickle.HIGHEST_PROTOCOL)
        back = _from_wire(pickle.loads(blob))
        for k, t in case.items():
            assert back[k].dtype == torch.int64 and torch.equal(back[k], t), (k, t.shape)
    meta = dict(fatal=None, keys=[], num_keys=0, keys_joined=None, **cases[0])
    raw = sum(t.numel() * 8 for t in cases[0].values())
    blob = pickle.dumps(_to_wire(meta), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < raw // 3, f"{len(blob)} bytes for {raw} bytes of tables"  # 3 columns of 10, two lengths


def test_two_ranks() -> None:
    run_ranks(2, run_all_2, timeout=150)


def test_three_ranks() -> None:
    run_ranks(3, run_all_3, timeout=150)


def _float_opmath_foreach_copy(dsts, srcs):
    """What CUDA's _foreach_copy_ does for bf16/fp16: through float, so NaN payloads become 0x7FFF."""
    for d, s in zip(dsts, srcs):
        d.copy_(s.float().to(d.dtype) if s.dtype in (torch.bfloat16, torch.float16) else s)


def _nan_payload_body(rank: int, world: int) -> None:
    import coalesced_bcast.state_dict as sd_mod
    model = nn.ParameterList([nn.Parameter(torch.zeros(512, dtype=torch.bfloat16)) for _ in range(8)])
    # 1 KiB each, four to a 4 KiB bucket: the copy-out batches them
    wants = [(torch.arange(512, dtype=torch.int32) * 7 + i).remainder(0x7F).add(0x7F81).to(torch.int16)
             for i in range(8)]  # bf16 NaNs, each with its own payload
    sd = {f"{i}": w.view(torch.bfloat16).clone() for i, w in enumerate(wants)} if rank == 0 else None
    real = torch._foreach_copy_
    torch._foreach_copy_ = _float_opmath_foreach_copy
    try:
        sd_mod.load_full_state_dict(model, sd, src=0, bucket_bytes=4096)
    finally:
        torch._foreach_copy_ = real
    for i, (p, w) in enumerate(zip(model, wants)):
        assert torch.equal(p.data.view(torch.int16), w), f"rank {rank}: NaN payloads of {i} changed"


def test_nan_payloads_survive_a_float_opmath_foreach_copy() -> None:
    """Regression (H200, torch 2.11): the copy-out must move bits even where _foreach_copy_ computes in float.
    The engine's scatter copies bytes and never calls _foreach_copy_; this keeps that true."""
    run_ranks(2, _nan_payload_body)


def _direct_body(rank: int, ws: int) -> None:
    """Buckets that lie inside one tensor (a 20 KiB weight over 4 KiB buckets) go straight from the source's
    checkpoint tensor and into each receiver's parameter (direct buckets); the rest through the slots;
    bitwise, NaN payloads included. A source loading the model's own tensors sends every bucket from its
    slot: its scatter would otherwise read what it writes."""
    g = torch.Generator().manual_seed(5)
    model = nn.ParameterDict({"a": nn.Parameter(torch.zeros(37, dtype=torch.bfloat16)),
                              "big": nn.Parameter(torch.zeros(10240, dtype=torch.bfloat16)),
                              "b": nn.Parameter(torch.zeros(5, 3))})
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    for v in sd.values():
        fill_random_bytes(v, g)
    stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    for k, v in model.state_dict().items():
        assert same_bits(v, sd[k]), f"'{k}' differs on rank {rank}"
    # the stream: a (80 bytes with padding), b (64), big from byte 144 to the end: buckets 1-5 lie inside big
    assert stats.direct_buckets == 5, stats
    if rank == 0:  # the model's own tensors, with new values, as the checkpoint
        for v in model.parameters():
            fill_random_bytes(v.data, g)
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        want = {k: v.clone() for k, v in sd.items()}
    stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    want = [want if rank == 0 else None]
    dist.broadcast_object_list(want, 0)
    for k, v in model.state_dict().items():
        assert same_bits(v, want[0][k]), f"'{k}' differs on rank {rank} (own tensors as the checkpoint)"
    assert stats.direct_buckets == (0 if rank == 0 else 5), stats


def test_direct_buckets_into_a_tensor() -> None:
    run_ranks(2, _direct_body)


def _ring_refused_body(rank: int, ws: int) -> None:
    """The ring is made before the agreement, as a sync's: a rank that cannot make it (out of memory) refuses
    there, every rank raises naming it, nothing is written, the source's early packs are dropped, and the next
    load goes through; on a load that goes through, the source's first buckets were packed before it."""
    def make() -> nn.Module:
        return nn.Sequential(*[nn.Linear(30, 30) for _ in range(4)])  # 15 kB: 4 buckets of 4 kB
    model = make()
    g = torch.Generator().manual_seed(5)
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    for v in sd.values():
        fill_random_bytes(v, g)
    prepare = coalesced_bcast._C.Plan.prepare
    made = []
    if rank == 1:
        def no_memory(plan, is_src, **options):
            raise torch.OutOfMemoryError("out of memory. Tried to allocate 8.00 KiB (a test's refusal)")
        coalesced_bcast._C.Plan.prepare = no_memory
    else:
        def recorded(plan, is_src, **options):
            made.append(prepare(plan, is_src, **options))
            return made[-1]
        coalesced_bcast._C.Plan.prepare = recorded
    before = snapshot(model)
    try:
        expect_error(lambda: load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096),
                     "no rank loaded anything", "rank 1 could not make its ring", "Tried to allocate 8.00 KiB")
    finally:
        coalesced_bcast._C.Plan.prepare = prepare
    after = snapshot(model)
    assert all(same_bits(before[k], after[k]) for k in before), f"a refused load wrote something on rank {rank}"
    if rank == 0:
        assert len(made) == 1 and made[0].packed == 2, "the source packed its first buckets before the agreement"
    del made
    coalesced_bcast._C.Plan.prepare = recorded if rank == 0 else prepare
    made = []
    try:
        stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    finally:
        coalesced_bcast._C.Plan.prepare = prepare
    assert stats.buckets > 2, stats
    got = model.state_dict()
    for k, v in sd.items():
        assert same_bits(got[k], v), f"'{k}' differs from the source's on rank {rank}"
    if rank == 0:
        assert len(made) == 1 and made[0].packed == 2, "the source packed its first buckets before the agreement"


def test_a_rank_without_memory_for_its_ring_refuses_in_the_agreement() -> None:
    run_ranks(2, _ring_refused_body)


class Casts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("i64", torch.zeros(6, dtype=torch.int64))
        self.register_buffer("flag", torch.zeros(5, dtype=torch.bool))
        self.w = nn.Parameter(torch.zeros(3, 70, dtype=torch.float32))
        self.h = nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
        self.c = nn.Parameter(torch.zeros(2, dtype=torch.complex128))
        # Torch's CPU copy_ casts a 0-dim tensor by its scalar conversion, others by its vectorized one: NaN
        # encodings differ (float32 NaN into bfloat16: 0x7FC0 against 0xFFFF; float16 signaling NaN into float32).
        self.s0 = nn.Parameter(torch.zeros((), dtype=torch.bfloat16))
        self.s1 = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.f0 = nn.Parameter(torch.zeros((), dtype=torch.float32))


def _casts_body(rank: int, ws: int) -> None:
    """Checkpoints in other dtypes, cast by the engine as load_state_dict casts (bitwise, NaN payloads
    included), in buckets small enough to split the tensors; a complex cast refused on every rank."""
    g = torch.Generator().manual_seed(3)
    sd = {"i64": torch.randint(-2**31, 2**31 - 1, (6,), generator=g, dtype=torch.int32),
          "flag": torch.tensor([0.0, -0.0, 2.5, float("nan"), 1.0]),
          "w": torch.empty(3, 70, dtype=torch.float64), "h": torch.empty(300, dtype=torch.float32),
          "c": torch.randn(2, dtype=torch.complex128, generator=g)}
    fill_random_bytes(sd["w"], g)
    fill_random_bytes(sd["h"], g)
    snan32 = torch.tensor([0x7FBA1234], dtype=torch.int32).view(torch.float32)
    sd.update(s0=snan32[0].clone(), s1=snan32.clone(),
              f0=torch.tensor([0x7C01], dtype=torch.int16).view(torch.float16)[0].clone())
    model = Casts()
    stats = load_full_state_dict(model, sd if rank == 0 else None, bucket_bytes=4096)
    ref = Casts()
    ref.load_state_dict(sd)
    for k in ("i64", "flag", "w", "h", "c", "s0", "s1", "f0"):
        assert same_bits(getattr(model, k), getattr(ref, k)), f"'{k}' differs from load_state_dict on rank {rank}"
    assert stats.cast_keys == 7, stats
    bad = dict(sd, c=sd["c"].to(torch.complex64))
    before = snapshot(model)
    expect_error(lambda: load_full_state_dict(model, bad if rank == 0 else None, bucket_bytes=4096),
                 '"c"', "ComplexFloat", "ComplexDouble", "complex and float8 must match")
    after = snapshot(model)
    assert all(same_bits(before[k], after[k]) for k in before), "a refused load wrote something"


def test_casts_as_load_state_dict() -> None:
    run_ranks(2, _casts_body)


class _Unpicklable:
    def __init__(self) -> None:
        import threading
        self.lock = threading.Lock()


def _remake_on_rank_0():
    if dist.get_rank() != 0:
        raise ModuleNotFoundError("no module named 'only_on_rank_0'")
    return _PickyExtra()


class _PickyExtra:
    """Pickles everywhere, unpickles only on rank 0 (as a class importable on the source alone)."""

    def __reduce__(self):
        return (_remake_on_rank_0, ())


class _WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.extra = {"step": 1}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = state


def _metadata_body(rank: int, ws: int) -> None:
    torch.manual_seed(5)
    model = _WithExtra()
    sd = dict(random_sd(model, seed=8)) if rank == 0 else None
    before = snapshot(model)
    for extra, needle in ((_Unpicklable(), "cannot be pickled"), (_PickyExtra(), "cannot be unpickled on rank 1")):
        if rank == 0:
            sd["_extra_state"] = extra
        expect_error(lambda: load_full_state_dict(model, sd, **SMALL), needle)
        after = snapshot(model)
        assert all(same_bits(before[k], after[k]) for k in before), f"{needle}: a tensor was written on rank {rank}"
        assert model.extra == {"step": 1}
    if rank == 0:
        sd["_extra_state"] = {"step": 2}
    load_full_state_dict(model, sd, **SMALL)  # the group is still usable, and the load goes through
    assert model.extra == {"step": 2} and same_bits(model.lin.weight, random_sd(_WithExtra(), seed=8)["lin.weight"])


def test_metadata_that_cannot_be_pickled_or_unpickled_raises_on_every_rank() -> None:
    """An extra state the source cannot pickle, or a receiver cannot unpickle, raises the same error on every
    rank before any write (before: the source raised alone and the others waited out the group's timeout)."""
    run_ranks(2, _metadata_body, timeout=120)


class _GetOnly(nn.Module):
    """Saves an extra state but does not take one back (set_extra_state not overridden)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def get_extra_state(self):
        return {"kind": "get-only"}


class _Legacy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_module("gone", None)  # a child set to None: checkpoint keys under it are passed over
        self.get_only = _GetOnly()
        self.scale = nn.Parameter(torch.tensor(0.5))  # 0-dim


def _forgive_aux(module: nn.Module, keys) -> None:
    """A post-hook as some models ship one: keys of an optional auxiliary head are neither missing nor
    unexpected (torch lets post-hooks edit the lists in place before strict is judged)."""
    for keys_list in (keys.missing_keys, keys.unexpected_keys):
        keys_list[:] = [k for k in keys_list if not k.startswith("aux.")]


def _torch_semantics_body(rank: int, ws: int) -> None:
    import copy
    from collections import OrderedDict
    torch.manual_seed(3)
    model = _Legacy()
    model.bn.num_batches_tracked.fill_(7)

    def model_with(hook):
        m = copy.deepcopy(model)
        m.register_load_state_dict_post_hook(hook)
        return m
    full = {k: v.clone() for k, v in random_sd(model, seed=9).items() if isinstance(v, torch.Tensor)}
    full["bn.num_batches_tracked"] = torch.tensor(12)
    cases = {
        # An old batch norm checkpoint (no num_batches_tracked, no _metadata): torch keeps the module's count.
        "bn without num_batches_tracked": ({k: v for k, v in full.items() if k != "bn.num_batches_tracked"}, None),
        # The same with _metadata at version 2 for the batch norm: now the key is missing.
        "bn version 2": ({k: v for k, v in full.items() if k != "bn.num_batches_tracked"}, {"bn": {"version": 2}}),
        # Keys under a child set to None: passed over.
        "keys under a None child": (dict(full, **{"gone.weight": torch.ones(2)}), None),
        # The get-only module's extra state in the checkpoint: unexpected (torch has no set_extra_state to call).
        "extra state of a get-only module": (dict(full, **{"get_only._extra_state": {"kind": "x"}}), None),
        # torch 0.3 saved scalars as 1-dim tensors of one element: they load into 0-dim tensors (cast too).
        "0-dim tensors from 1-dim values of one element": (dict(full, **{
            "bn.num_batches_tracked": torch.tensor([12]), "scale": torch.tensor([2.5], dtype=torch.float64)}), None),
        # Of more than one element: a size mismatch.
        "a 0-dim tensor from a 1-dim value of three": (dict(full, scale=torch.tensor([1.0, 2.0, 3.0])), None),
    }
    hooked = copy.deepcopy(model)
    hooked.aux = nn.Linear(2, 2)
    hooked.register_load_state_dict_post_hook(_forgive_aux)
    hooked_sd = {k: v.clone() for k, v in random_sd(hooked, seed=10).items() if isinstance(v, torch.Tensor)}
    cases = {what: (sd, md, model) for what, (sd, md) in cases.items()}
    cases.update({
        # A post-hook clears the aux keys: the checkpoint may lack them or hold extra ones, strict or not.
        "missing keys a post-hook clears": ({k: v for k, v in hooked_sd.items() if not k.startswith("aux.")}, None,
                                            hooked),
        "unexpected keys a post-hook clears": (dict(full, **{"aux.extra": torch.ones(3)}), None, model_with(
            _forgive_aux)),
        # It leaves other keys: strict still fails, on every rank.
        "a key a post-hook does not clear": ({k: v for k, v in hooked_sd.items() if k != "lin.bias"}, None, hooked),
    })
    for what, (sd, md, model) in cases.items():
        if md is not None:
            sd = OrderedDict(sd)
            sd._metadata = OrderedDict(md)
        for strict in (True, False):
            ref = copy.deepcopy(model)
            try:
                want = ref.load_state_dict(sd, strict=strict)
                want_error = None
            except RuntimeError as e:
                want_error = str(e)
            mine = copy.deepcopy(model)
            try:
                got = load_full_state_dict(mine, sd if rank == 0 else None, strict=strict, **SMALL)
                got_error = None
            except LoadStateDictError as e:
                got_error = str(e)
            assert (want_error is None) == (got_error is None), f"{what}, strict={strict}: torch {want_error!r}, " \
                                                                f"ours {got_error!r}"
            if want_error is not None:
                continue
            assert sorted(got.missing_keys) == sorted(want.missing_keys), (what, strict, got, want)
            assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys), (what, strict, got, want)
            for k, v in ref.state_dict().items():
                if isinstance(v, torch.Tensor):
                    assert same_bits(mine.state_dict()[k], v), f"{what}, strict={strict}: '{k}' differs"

    # A post-hook that raises on one rank while strict waits for the hooks: every rank raises, none waits.
    def fail_on_rank_1(module: nn.Module, keys) -> None:
        if rank == 1:
            raise RuntimeError("the hook failed")
        _forgive_aux(module, keys)

    sd = dict(full, **{"aux.extra": torch.ones(3)})
    try:
        load_full_state_dict(model_with(fail_on_rank_1), sd if rank == 0 else None, **SMALL)
        raise AssertionError(f"rank {rank}: no error")
    except LoadStateDictError as e:
        assert "rank 1 still has" in str(e) and "the hook failed" in str(e), str(e)


def test_load_state_dict_semantics_of_old_checkpoints_none_children_and_get_only_extra_state() -> None:
    """As torch's load_state_dict: batch norm counts filled in for old checkpoints, keys under a child set to
    None passed over, a module without set_extra_state neither expects nor takes its extra state key, and
    post-hooks that clear missing or unexpected keys before strict is judged (before, strict was judged
    before the hooks ran, so such a load failed where torch's succeeded)."""
    run_ranks(2, _torch_semantics_body, timeout=120)


class _Doubled(nn.Linear):
    """Load logic of its own: the checkpoint's weight doubled on the way in."""

    def _load_from_state_dict(self, sd, prefix, *args):
        sd = dict(sd)
        if prefix + "weight" in sd:
            sd[prefix + "weight"] = sd[prefix + "weight"] * 2
        super()._load_from_state_dict(sd, prefix, *args)


def _transpose_on_load(module, sd, prefix, *args):
    if prefix + "weight" in sd:
        sd[prefix + "weight"] = sd[prefix + "weight"].t().contiguous()


def _legacy_key_on_load(sd, prefix, *args):  # renames a key of an older layout; nothing to do for current ones
    if prefix + "w" in sd:
        sd[prefix + "weight"] = sd.pop(prefix + "w")


def _custom_load_logic_body(rank: int, world_size: int) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.nn.utils import spectral_norm
    from torch.nn.utils.parametrizations import weight_norm

    def served():  # torch's own load logic (checkpoint_wrapper's key prefix, weight_norm, spectral_norm, batch
        # norm), and a compatibility pre-hook of the model's own that changes nothing for this checkpoint
        m = nn.Sequential(checkpoint_wrapper(nn.Linear(6, 6)), weight_norm(nn.Linear(6, 5)),
                          spectral_norm(nn.Linear(5, 5)), nn.BatchNorm1d(5))
        m[2]._register_load_state_dict_pre_hook(_legacy_key_on_load)
        return m

    def refused(kind):
        m = nn.Sequential(nn.Linear(4, 4), _Doubled(4, 4) if kind == "override" else nn.Linear(4, 4))
        if kind == "pre_hook":
            m[1]._register_load_state_dict_pre_hook(_transpose_on_load, with_module=True)  # torch 2.4: no public one
        return m

    for make in (served, lambda: refused("override"), lambda: refused("pre_hook")):
        torch.manual_seed(0)
        source = make()
        with torch.no_grad():
            for t in source.state_dict().values():
                if t.is_floating_point():
                    t.normal_()
        sd = {k: v.clone() for k, v in source.state_dict().items()}
        want = make()
        want.load_state_dict({k: v.clone() for k, v in sd.items()})
        model = make()
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.fill_(7.0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if make is served:
            load_full_state_dict(model, sd if rank == 0 else None)
            for k, v in model.state_dict().items():
                assert same_bits(v, want.state_dict()[k]), f"'{k}' differs from load_state_dict's on rank {rank}"
            continue
        with pytest.raises(LoadStateDictError, match=r"'1' \((_Doubled|Linear)\) (overrides _load_from_state_dict|"
                           r"has a load_state_dict pre-hook \(_transpose_on_load\) that changed '1.weight').*"
                           r"skip_custom_load_logic=True"):
            load_full_state_dict(model, sd if rank == 0 else None)
        for k, v in model.state_dict().items():
            assert same_bits(v, before[k]), f"'{k}' was written by a refused load on rank {rank}"
        # Asked to, the load copies the checkpoint's values as they are (not what load_state_dict makes of them).
        load_full_state_dict(model, sd if rank == 0 else None, skip_custom_load_logic=True)
        for k, v in model.state_dict().items():
            assert same_bits(v, sd[k]), f"'{k}' is not the checkpoint's value on rank {rank}"
        assert not same_bits(model[1].weight, want[1].weight)  # what the custom logic would have made differs


def test_modules_with_load_logic_of_their_own_are_refused_on_every_rank() -> None:
    """A _load_from_state_dict override, or a load pre-hook that changes the checkpoint's keys or values, defined
    outside torch, would not run in this load, so it is refused on every rank, naming the module, with nothing
    written (before, the values were written as plain copies: a silent difference from load_state_dict). Torch's
    own load logic is served as it was, and so is a compatibility pre-hook with nothing to do."""
    run_ranks(2, _custom_load_logic_body, timeout=120)

"""install() on CPU over gloo: DDP and FSDP1 init go through coalesced_bcast and end bitwise equal to the source."""
import logging
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks
from zoo import same_bits

SOURCE_SEED = 1234
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, hidden=24):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.register_buffer("scale", torch.rand(hidden))
        self.register_buffer("inv_freq", torch.rand(hidden // 2, dtype=torch.float64), persistent=False)


class Head(nn.Linear):
    """Its own class so that a wrap policy can make it a unit of its own."""


class Net(nn.Module):
    def __init__(self, tied: bool, hidden=24, vocab=40, layers=3, wide_block: int = -1):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden + (1 if i == wide_block else 0)) for i in range(layers))
        self.norm = nn.BatchNorm1d(hidden)
        self.head = Head(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("rope", torch.zeros(hidden, dtype=torch.bfloat16), persistent=False)


def build(tied: bool, seed: int, device=CPU, **kw) -> Net:
    """Every float tensor random and every int buffer random, so that ranks built from other seeds differ."""
    torch.manual_seed(seed)
    with torch.device(device):
        net = Net(tied, **kw)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.uniform_(-1, 1) if t.is_floating_point() else t.random_(0, 1000)
    return net


def states(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied names included, FSDP prefixes dropped."""
    out = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        out[n.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def assert_same(got: dict, want: dict, what: str, rank: int) -> None:
    assert got.keys() == want.keys(), f"{what} rank {rank}: names {sorted(got.keys() ^ want.keys())}"
    wrong = [n for n in want if not same_bits(got[n], want[n])]
    assert not wrong, f"{what} rank {rank}: differs from the source at {wrong}"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def same_error_everywhere(fn) -> str:
    """Run fn, expecting it to raise on this rank; check every rank raised the same message."""
    try:
        fn()
    except coalesced_bcast.AgreementError as e:
        msg = str(e)
    else:
        msg = "no error"
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, msg)
    assert msg != "no error", f"rank {dist.get_rank()} did not raise"
    assert len(set(every)) == 1, f"ranks raised different errors: {every}"
    return msg


# ------------------------------------------------------------------------------------------------ DDP

def _ddp_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_mod = sys.modules["torch.nn.parallel.distributed"]
    torch_fn = ddp_mod._sync_module_states
    for tied in (False, True):
        want = states(build(tied, SOURCE_SEED))
        model = build(tied, SOURCE_SEED if rank == 0 else 99 + rank)
        before = states(model)
        if rank:
            assert all(not same_bits(before[n], want[n]) for n in want)  # a sync that wrote nothing fails
        coalesced_bcast.patched_calls(clear=True)
        with coalesced_bcast.installed():
            assert ddp_mod._sync_module_states is not torch_fn
            DDP(model)
        assert ddp_mod._sync_module_states is torch_fn
        assert_same(states(model), want, f"DDP tied={tied}", rank)
        calls = coalesced_bcast.patched_calls()
        unique = len(dict.fromkeys(map(id, [*model.parameters(), *model.buffers()])))
        assert [c.site for c in calls] == ["ddp"] and calls[0].stats.unique_tensors == unique, calls
        assert model.head.weight is model.embed.weight or not tied

    # Meta-built on the other ranks, no init compute: ties kept by the materializer applied to every
    # module, or split by to_empty and restored from the source's names (one small collective).
    want = states(build(True, SOURCE_SEED))
    for how in ("apply", "to_empty"):
        model = build(True, SOURCE_SEED) if rank == 0 else build(True, 0, device="meta")
        if rank and how == "apply":
            model.apply(coalesced_bcast.fsdp.param_init_fn(CPU))
        elif rank:
            model.to_empty(device=CPU)
            assert model.head.weight is not model.embed.weight  # what pytorch issue 143181 is about
        retied = coalesced_bcast.fsdp.restore_ties(model, src=0)
        assert retied == (1 if rank and how == "to_empty" else 0), (how, retied)
        assert model.head.weight is model.embed.weight, how
        with coalesced_bcast.installed():
            DDP(model)
        assert_same(states(model), want, f"DDP meta {how}", rank)

    # Ignored names stay local, as with torch's own sync; so do buffers when DDP is told not to send them.
    want = states(build(False, SOURCE_SEED))
    model = build(False, SOURCE_SEED if rank == 0 else 99 + rank)
    mine = states(model)
    model._ddp_params_and_buffers_to_ignore = ["blocks.1.up.bias", "blocks.0.scale"]
    with coalesced_bcast.installed():
        DDP(model)
    got = states(model)
    for n in want:
        expected = mine[n] if n in model._ddp_params_and_buffers_to_ignore else want[n]
        assert same_bits(got[n], expected), f"DDP ignore rank {rank}: {n}"
    assert rank == 0 or not same_bits(got["blocks.1.up.bias"], want["blocks.1.up.bias"])

    model = build(False, SOURCE_SEED if rank == 0 else 99 + rank)
    mine = states(model)
    buffer_names = {n for n, _ in model.named_buffers()}
    with coalesced_bcast.installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # newer torch deprecates the argument's name
        DDP(model, broadcast_buffers=False)
    got = states(model)
    for n in want:
        assert same_bits(got[n], mine[n] if n in buffer_names else want[n]), f"DDP no buffers rank {rank}: {n}"


def test_uninstall_restores_torch():
    import torch.distributed.fsdp._init_utils as fsdp_init
    import torch.nn.parallel.distributed as ddp_mod
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    names = [(fsdp_init, "_sync_module_params_and_buffers"), (fsdp_init, "_sync_params_and_buffers"),
             (fsdp_init, "_check_module_states_for_sync_module_states"),
             (fsdp_init, "_materialize_with_param_init_fn"), (FlatParamHandle, "flatten_tensors"),
             (ddp_mod, "_sync_module_states"), (ddp_mod, "_verify_param_shape_across_processes")]
    originals = [getattr(m, n) for m, n in names]
    assert not coalesced_bcast.is_installed()
    patched = coalesced_bcast.install()
    try:
        assert patched == [f"{getattr(m, '__module__', m.__name__)}.{m.__name__}.{n}" if isinstance(m, type)
                           else f"{m.__name__}.{n}" for m, n in names]
        assert coalesced_bcast.install() == patched  # idempotent
        now = [getattr(m, n) for m, n in names]
        assert all(a is not b and a.__wrapped__ is b for a, b in zip(now, originals))
        with coalesced_bcast.installed():  # nested: leaves the outer install in place
            pass
        assert [getattr(m, n) for m, n in names] == now
    finally:
        coalesced_bcast.uninstall()
    assert all(getattr(m, n) is o for (m, n), o in zip(names, originals))
    coalesced_bcast.uninstall()  # a no-op
    assert all(getattr(m, n) is o for (m, n), o in zip(names, originals))


def test_install_names_what_this_torch_lacks(monkeypatch, caplog):
    import torch.distributed.fsdp._init_utils as fsdp_init
    import torch.nn.parallel.distributed as ddp_mod
    monkeypatch.delattr(fsdp_init, "_check_module_states_for_sync_module_states")
    torch_ddp = ddp_mod._sync_module_states
    with caplog.at_level(logging.INFO, logger="coalesced_bcast"):
        with coalesced_bcast.installed() as patched:
            assert len(patched) == 6 and ddp_mod._sync_module_states is not torch_ddp
    missing = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(missing) == 1 and "_check_module_states_for_sync_module_states" in missing[0] \
        and torch.__version__ in missing[0], missing
    assert ddp_mod._sync_module_states is torch_ddp
    assert not hasattr(fsdp_init, "_check_module_states_for_sync_module_states")  # not created by uninstall


# ---------------------------------------------------------------------------------------------- FSDP1

def _framework_wrapper(fn):
    """A param_init_fn wrapped the way frameworks wrap one (accelerate's ensure_weights_retied: a closure
    that calls it as `module = fn(module)` and reads the module's ties from the result)."""
    def wrapped(module):
        module = fn(module)
        assert isinstance(module, nn.Module), "param_init_fn must return the module"
        return module
    return wrapped


def _fsdp(model, units, init_fn, **kw):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units), device_id=CPU, sync_module_states=True,
                param_init_fn=init_fn, **kw)


def _full_states(model) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(model, writeback=False):
        return states(model)


def _fsdp_body(rank, world_size):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    records = Records()
    logging.getLogger("coalesced_bcast").addHandler(records)
    logging.getLogger("coalesced_bcast").setLevel(logging.DEBUG)

    # Without install(), FSDP1 refuses CPU modules in sync_module_states.
    with pytest.raises(ValueError, match="on GPU"):
        _fsdp(build(False, SOURCE_SEED), {Block}, None)

    plain_to_empty = lambda m: m.to_empty(device=CPU, recurse=False)  # noqa: E731  (pytorch issue 143181)
    ours = coalesced_bcast.fsdp.param_init_fn
    # (tied, units, param_init_fn on meta ranks, FSDP kwargs, units whose FlatParameter is our buffer
    # on the source and on the other ranks: the others' units are laid out in one buffer by our
    # param_init_fn (or, with another, before the sync), the source's before the sync; a unit of one
    # parameter is left alone on the source; a padded unit is copied by FSDP as usual)
    cases = [
        (False, {Block}, ours(CPU), {}, 4, 4),
        (True, {Block}, ours(CPU), {}, 4, 4),  # embed and head in the root unit
        (True, {Block, Head}, ours(CPU), {}, 4, 5),  # the tie crosses units: the root's embed is no longer meta
        (True, {Block}, plain_to_empty, {}, 4, 4),  # split by to_empty: re-tied from the source's names
        (True, {Block}, _framework_wrapper(ours(CPU)), {}, 4, 4),  # wrapped by a framework: layout kept
        (True, {Block}, "accelerate", {}, 4, 4),  # accelerate's own ensure_weights_retied around ours
        (False, {Block}, ours(CPU), {"use_orig_params": True}, 4, 4),  # no padding needed: all sizes aligned
        (False, {Block}, ours(CPU), {"use_orig_params": True, "wide_block": 1}, 3, 3),  # wide block padded
    ]
    coalesced_bcast.install()
    try:
        for tied, units, init_fn, kw, in_place_src, in_place in cases:
            kw = dict(kw)
            shape = {"wide_block": kw.pop("wide_block")} if "wide_block" in kw else {}
            label = f"FSDP1 tied={tied} units={sorted(u.__name__ for u in units)} init={init_fn} {kw} {shape}"
            want = states(build(tied, SOURCE_SEED, **shape))
            model = build(tied, SOURCE_SEED, **shape) if rank == 0 else build(tied, 0, device="meta", **shape)
            if init_fn == "accelerate":  # as accelerate's FSDP1 plugin wraps a param_init_fn for a tied model
                try:
                    from accelerate.utils.fsdp_utils import ensure_weights_retied
                except ImportError:
                    continue  # scripts/setup.sh installs it: CI runs this case
                model._tied_weights_keys = ["head.weight"]  # what a Hugging Face model declares
                init_fn = ensure_weights_retied(ours(CPU), model, CPU)
                label += " (accelerate)"
            coalesced_bcast.patched_calls(clear=True)
            records.messages.clear()
            before = coalesced_bcast.fsdp.arena_counts()
            fsdp = _fsdp(model, units, init_fn, **kw)
            counts = {k: v - before[k] for k, v in coalesced_bcast.fsdp.arena_counts().items()}
            calls = coalesced_bcast.patched_calls()
            assert calls and {c.site for c in calls} == {"fsdp1"}, f"{label}: {calls}"
            assert len(calls) == len(FSDP.fsdp_modules(fsdp)), f"{label}: one sync per unit, got {len(calls)}"
            assert counts["flattened_in_place"] == (in_place if rank else in_place_src), f"{label}: {counts}"
            # The same broadcasts on every rank; a block's six parameters, back to back in one buffer on
            # every rank, go as one (its two buffers are separate tensors: two more).
            ops = [c.stats.inplace_ops for c in calls]
            every = [None] * world_size
            dist.all_gather_object(every, ops)
            assert all(o == ops for o in every), f"{label}: {every}"
            assert ops[:3] == ([3, 1, 3] if shape else [3, 3, 3]), f"{label}: {ops}"
            assert counts["arenas"] == counts["flattened_in_place"] + counts["flattened_by_copy"] + \
                counts["superseded"], f"{label}: {counts}"
            # a unit re-tied after to_empty is laid out again, its first buffer superseded
            assert counts["superseded"] == (1 if init_fn is plain_to_empty and rank else 0), f"{label}: {counts}"
            assert_same(_full_states(fsdp), want, label, rank)
            if tied:
                inner = fsdp.module
                with FSDP.summon_full_params(fsdp, writeback=False):
                    assert same_bits(inner.head.weight, inner.embed.weight), label
            retied = [m for m in records.messages if "re-tied" in m]
            assert bool(retied) == (init_fn is plain_to_empty and rank != 0), f"{label}: {records.messages}"
            assert all(not isinstance(b, torch.Tensor) or not b.is_meta for b in fsdp.buffers()), label
            # Once no module holds a meta tensor, the materializer holds none of the originals (else the
            # whole unsharded model would stay alive beside FSDP's shards).
            assert not getattr(init_fn, "_memo", None), f"{label}: {len(init_fn._memo)} originals kept"

        # A real structural difference: every rank raises the same error, naming the tensor; none hangs.
        model = build(False, SOURCE_SEED) if rank == 0 else build(False, 0, device="meta", wide_block=1)
        msg = same_error_everywhere(lambda: _fsdp(model, {Block}, coalesced_bcast.fsdp.param_init_fn(CPU)))
        assert "does not match source rank 0" in msg and "'<Block>." in msg and "restoring" in msg, msg

        # On a group without gloo the refusal stays: torch's own words first (its FSDP tests match them),
        # then the tensor and the rank.
        install_mod = sys.modules["coalesced_bcast.install"]
        net = build(False, SOURCE_SEED)
        token = install_mod._unit.set(install_mod._FsdpUnit(net, dist.group.WORLD, cpu_ok=False))
        try:
            with pytest.raises(ValueError) as info:
                sys.modules["torch.distributed.fsdp._init_utils"]._check_module_states_for_sync_module_states(
                    [p.detach() for p in net.parameters()])
            msg = str(info.value)
            assert msg.startswith("The module has CPU parameters or buffers when `sync_module_states=True`"), msg
            assert f"rank {rank}" in msg and "'<Net>.embed.weight'" in msg, msg
        finally:
            install_mod._unit.reset(token)
    finally:
        coalesced_bcast.uninstall()


def _init_body(rank, world_size):
    _ddp_body(rank, world_size)
    _fsdp_body(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_and_fsdp1_init_bitwise(world_size):
    """One spawn per world size for both (spawning dominates the runtime on 2 cores)."""
    run_ranks(world_size, _init_body)


def test_lay_out_unit_copies_into_one_buffer_keeping_values_and_ties(monkeypatch):
    """What install() does to a unit before its sync on a rank whose unit is real (rank 0)."""
    fsdp = coalesced_bcast.fsdp
    torch.manual_seed(0)
    net = build(True, SOURCE_SEED)  # head.weight is embed.weight
    # Out of memory for the buffer: the unit stays as it is (the rank still joins the sync).
    with monkeypatch.context() as m:
        def no_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("test")
        m.setattr(torch, "cat", no_memory)  # the buffer is the copy's output
        kept = list(net.parameters())
        assert not fsdp.lay_out_unit(net, kept)
        assert all(a is b for a, b in zip(kept, net.parameters()))
    named = dict(net.named_parameters(remove_duplicate=False))
    before = {n: t.detach().clone() for n, t in named.items()}
    params = list(net.parameters())  # FSDP's managed list: deduplicated, registration order
    old_ids = [id(p) for p in params]
    counts = fsdp.arena_counts()
    assert fsdp.lay_out_unit(net, params)
    after = dict(net.named_parameters(remove_duplicate=False))
    assert all(same_bits(after[n], before[n]) for n in before), "values changed"
    assert after["head.weight"] is after["embed.weight"], "the tie was split"
    assert [id(p) for p in params] != old_ids and all(p is after[n] for n, p in net.named_parameters())
    # one storage, back to back in FSDP1's flatten order, which flatten_in_place then takes as it is
    order = [p for _, p in net.named_parameters()]
    assert len({p.untyped_storage().data_ptr() for p in order}) == 1
    assert [p.storage_offset() for p in order] == [sum(q.numel() for q in order[:i]) for i in range(len(order))]
    flat = fsdp.flatten_in_place(order, 0)
    assert flat is not None and flat.numel() == sum(p.numel() for p in order)
    assert flat.untyped_storage().data_ptr() == order[0].untyped_storage().data_ptr()
    assert fsdp.arena_counts()["flattened_in_place"] == counts["flattened_in_place"] + 1
    # already one buffer: left alone; several dtypes: left alone
    assert not fsdp.lay_out_unit(net, list(net.parameters()))
    mixed = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4).double()})
    assert not fsdp.lay_out_unit(mixed, list(mixed.parameters()))


def test_param_init_fn_returns_the_module_it_was_given():
    """Frameworks wrap param_init_fn and use its result (accelerate: module = fn(module); module.weight)."""
    fn = coalesced_bcast.fsdp.param_init_fn(CPU)
    with torch.device("meta"):
        lin = nn.Linear(4, 3)
    assert fn(lin) is lin and not lin.weight.is_meta and lin.weight.shape == (3, 4)
    assert fn(lin) is lin  # already real: left alone, still returned


def _hsdp_body(rank, world_size):
    """FSDP1 hybrid sharding with sync_module_states: torch syncs each unit over the inter-node group,
    then the intra-node group; both go through coalesced_bcast and every rank ends with the source's
    values. (A mesh whose shard dimension has one rank makes FSDP1 fall back to NO_SHARD, which syncs
    nothing across ranks with or without install(): not tested here.)"""
    import inspect

    import torch.distributed.fsdp._init_utils as fsdp_init
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy
    want = states(build(False, SOURCE_SEED))
    # torch 2.4's FSDP1 syncs an HSDP unit within the shard group first, which marks its buffers synced
    # (FSDP_SYNCED), so the sync across replicas that follows skips them; later torch syncs across
    # replicas first. Told apart by which group its init code names first.
    init_src = inspect.getsource(fsdp_init._init_param_handle_from_module)
    inter_node_syncs_buffers = init_src.find("_inter_node_pg") < init_src.find("state.process_group")
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        for shape in ((2, 2), (1, 4)):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            model = build(False, SOURCE_SEED if rank == 0 else 50 + rank)
            coalesced_bcast.patched_calls(clear=True)
            with coalesced_bcast.installed():
                fsdp = _fsdp(model, {Block}, None, sharding_strategy=strategy, device_mesh=mesh)
            got = _full_states(fsdp)
            if not inter_node_syncs_buffers and shape[0] > 1 and rank >= shape[1]:
                # torch's own behaviour, which install() keeps: each replica keeps its own buffers.
                buffers = {n.replace("_fsdp_wrapped_module.", "") for n, _ in fsdp.named_buffers()}
                assert any(not same_bits(got[n], want[n]) for n in buffers), "buffers synced across replicas"
                got, want_here = ({n: v for n, v in d.items() if n not in buffers} for d in (got, want))
            else:
                want_here = want
            assert_same(got, want_here, f"HSDP {strategy} mesh {shape}", rank)
            calls = coalesced_bcast.patched_calls()
            assert calls and all(c.fallback is None for c in calls), calls
            assert len(calls) == 2 * len(type(fsdp).fsdp_modules(fsdp)), f"{strategy} {shape}: {len(calls)} syncs"


def test_hsdp_sync_module_states_on_four_ranks():
    run_ranks(4, _hsdp_body, timeout=240)


def test_hsdp_two_ranks_meshes_1x2_and_2x1():
    """The 2-GPU HSDP check of tests/test_gpu_nccl.py, on the CPU over gloo (install() only: FSDP1 refuses
    CPU modules in sync_module_states without it)."""
    from test_gpu_nccl import hsdp_same_outcome_body
    run_ranks(2, hsdp_same_outcome_body, "cpu", timeout=240)

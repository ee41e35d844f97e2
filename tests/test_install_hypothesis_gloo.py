"""install()'s DDP init sync against torch's own, on random modules, in ONE 2-rank gloo group: whatever torch's
``_sync_module_states`` makes of a module, the patched one must make of it too, bit for bit, on every rank.

Each example builds a module tree (every rank from its own seed, so ranks differ before the sync) of
parameters (trainable or frozen, non-contiguous ones among them), persistent and non-persistent buffers,
a None buffer, a parameter or buffer registered in two places (ties), a conjugate view, buffers that are views
of a parameter (a row, the transpose: torch's path serves those, and the patched one hands them to it), 0-dim and
empty tensors, every dtype torch's gloo broadcast takes; then runs torch's own function on one copy and the
patched one (``install()``) on another, with random ``params_and_buffers_to_ignore`` and ``broadcast_buffers``,
and compares every tensor's bits. The patched call must be served by coalesced_bcast except where a view
overlaps a parameter or has a conjugate bit, and handed back (with the reason recorded) there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import strategies as st
from torch.nn.parallel import distributed as ddp_mod

import coalesced_bcast
from dist_utils import run_ranks
from ranked_hypothesis import examples_on_ranks
from zoo import fill_random_bytes, same_bits

EXAMPLES = 80
# What torch's gloo broadcast takes (int16, float8 and the unsigned beyond uint8 it refuses: "Invalid scalar type")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.complex64, torch.complex128]
PARAM_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]  # trainable ones
KINDS = ["param", "param", "frozen", "buffer", "buffer", "buffer_np", "none", "tie", "row_view", "t_view", "conj"]


@st.composite
def specs(draw):
    entries = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(KINDS))
        params = [i for i, e in enumerate(entries) if e["kind"] in ("param", "frozen") and len(e["shape"]) == 2]
        if kind in ("tie",) and not entries or kind in ("row_view", "t_view") and not params:
            kind = "param"
        e = dict(kind=kind, module=draw(st.integers(0, 2)))
        if kind == "tie":
            e["of"] = draw(st.integers(0, len(entries) - 1))
        elif kind in ("row_view", "t_view"):
            e["of"] = draw(st.sampled_from(params))
        elif kind != "none":
            ndim = draw(st.integers(0, 3))
            e["shape"] = tuple(draw(st.lists(st.one_of(st.integers(0, 3), st.integers(1, 30)), min_size=ndim,
                                             max_size=ndim)))
            pool = PARAM_DTYPES if kind == "param" else [torch.complex64, torch.complex128] if kind == "conj" else DTYPES
            e["dtype"] = draw(st.sampled_from(pool))
            e["transposed"] = ndim == 2 and draw(st.booleans())  # stored as the transpose of a contiguous tensor
        entries.append(e)
    return dict(entries=entries, seed=draw(st.integers(0, 2**31 - 1)), broadcast_buffers=draw(st.booleans()),
                ignore=draw(st.lists(st.integers(0, 7), max_size=3)))


def _tensor(e, gen) -> torch.Tensor:
    shape = e["shape"]
    t = torch.empty(shape[::-1] if e["transposed"] else shape, dtype=e["dtype"])
    fill_random_bytes(t, gen)
    return t.t() if e["transposed"] else t


def build(spec, rank: int) -> tuple[nn.Module, list[str]]:
    """The module on `rank` (its values from the rank's seed) and the names registered, in spec order."""
    gen = torch.Generator().manual_seed(spec["seed"] * 3 + rank)
    root = nn.Module()
    subs = [root, nn.Module(), nn.Module()]
    root.a, root.b = subs[1], subs[2]
    made, names = [], []
    for i, e in enumerate(spec["entries"]):
        m, name, kind = subs[e["module"]], f"x{i}", e["kind"]
        prefix = ["", "a.", "b."][e["module"]]
        if kind in ("param", "frozen"):
            t = nn.Parameter(_tensor(e, gen), requires_grad=kind == "param")
            m.register_parameter(name, t)
        elif kind == "none":
            t = None
            m.register_buffer(name, None)
        elif kind == "tie":
            t = made[e["of"]]
            if isinstance(t, nn.Parameter):
                m.register_parameter(name, t)
            else:
                m.register_buffer(name, t)
        elif kind in ("row_view", "t_view"):
            p = made[e["of"]]
            t = p.data[min(1, p.shape[0] - 1)] if kind == "row_view" and p.shape[0] else p.data.t()
            m.register_buffer(name, t)
        elif kind == "conj":
            t = _tensor(e, gen).conj()
            m.register_buffer(name, t)
        else:
            t = _tensor(e, gen)
            m.register_buffer(name, t, persistent=kind == "buffer")
        made.append(t)
        names.append(prefix + name)
    return root, names


def _states(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*module.named_parameters(remove_duplicate=False),
                                               *module.named_buffers(remove_duplicate=False)]}


def _synced(module: nn.Module, ignore: set[str], broadcast_buffers: bool) -> list[torch.Tensor]:
    """The tensors DDP's init sync takes, as torch.distributed.utils._sync_module_states lists them: each
    parameter and buffer under its first name, less the ignored names."""
    out = [p for n, p in module.named_parameters() if n not in ignore]
    if broadcast_buffers:
        out += [b for n, b in module.named_buffers() if n not in ignore]
    return out


def _expected_route(synced: list[torch.Tensor]) -> str:
    """"conj": a lazy conjugate bit (refused in the planner's per-tensor pass, so handed back); "overlap": two
    different tensors share memory (handed back where the planner proves an overlap, else served); "served"."""
    if any(t.is_conj() for t in synced):
        return "conj"
    storages = [t.untyped_storage().data_ptr() for t in synced if t.numel() > 0]
    return "overlap" if len(set(storages)) < len(storages) else "served"


def _ignored(spec) -> set[str]:
    return {f"x{i}" for i in spec["ignore"] if i < len(spec["entries"])}


def run_example(rank: int, spec) -> bool:
    pg = dist.group.WORLD
    probe, names = build(spec, rank)
    ignore = {n for n in names if n.split(".")[-1] in _ignored(spec)}
    route = _expected_route(_synced(probe, ignore, spec["broadcast_buffers"]))
    outcomes, states = [], []
    for patched in (False, True):
        model, _ = build(spec, rank)
        coalesced_bcast.patched_calls(clear=True)
        try:
            if patched:
                with coalesced_bcast.installed():
                    ddp_mod._sync_module_states(model, pg, 250 * 2**20, 0, ignore, spec["broadcast_buffers"])
            else:
                ddp_mod._sync_module_states(model, pg, 250 * 2**20, 0, ignore, spec["broadcast_buffers"])
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - compared below
            outcomes.append(f"{type(e).__name__}: {e}")
        states.append(_states(model))
        calls = coalesced_bcast.patched_calls()
    problems = []
    if outcomes[0] == "ok" and outcomes[1] != "ok":
        problems.append(f"torch's sync worked, the patched one raised {outcomes[1]}")
    if outcomes == ["ok", "ok"]:
        wrong = [n for n in states[0] if not same_bits(states[0][n], states[1][n])]
        if wrong:
            kinds = {n: spec["entries"][int(n.split(".")[-1][1:])] for n in wrong}
            problems.append(f"differs from torch's sync at {kinds}; calls {calls}")
        if calls:  # a module with nothing to send makes no call
            last = calls[-1]
            if route == "conj":
                if last.stats is not None or "conjugate" not in last.fallback:
                    problems.append(f"a conjugate view not handed back: {last}")
            elif route == "overlap":
                # Handed back where the planner proves the overlap; where it cannot (a strided row of a transposed
                # parameter), where the view is the parameter's own bytes (an alias, sent once) or where the bytes
                # only interleave, it serves the call, and the bits above match torch's.
                if last.stats is None and "overlapping" not in last.fallback:
                    problems.append(f"handed back for another reason: {last}")
            elif last.stats is None:
                problems.append(f"handed back to torch: {last.fallback}")
    for p in problems:
        print(f"rank {rank}: {p}; outcomes {outcomes}", flush=True)
    return not problems


def _body(rank, world_size, out_dir):
    explicit = [dict(entries=[dict(kind="param", module=0, shape=(4, 3), dtype=torch.float32, transposed=False),
                              dict(kind="row_view", module=1, of=0), dict(kind="t_view", module=2, of=0),
                              dict(kind="conj", module=0, shape=(5,), dtype=torch.complex64, transposed=False)],
                     seed=3, broadcast_buffers=True, ignore=[])]
    examples_on_ranks(rank, specs(), lambda spec: run_example(rank, spec), EXAMPLES, out_dir, explicit)
    dist.barrier()


def test_ddp_init_sync_matches_torchs_on_random_modules(tmp_path):
    run_ranks(2, _body, str(tmp_path), timeout=600)
    assert int((tmp_path / "count").read_text()) >= EXAMPLES

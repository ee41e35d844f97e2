"""load_full_state_dict against torch's own ``load_state_dict`` on random plain modules, in ONE 2-rank gloo group:
every rank must end as ``load_state_dict(sd, strict)`` leaves a module on one process, bit for bit, or raise
where it raises (then with nothing written, where torch writes what it can before it raises).

Each example builds a module tree (every rank poisoned from its own seed) of Linear layers (with and without
bias, other dtypes), BatchNorm1d (running stats and num_batches_tracked), modules of random parameters (0-dim
ones too) and buffers (persistent, non-persistent, None, every dtype), a child set to None, a Linear whose
weight is another's (a tie), a module with extra state; and a checkpoint from a source model of the same
structure with some values cast to another dtype, stored transposed or expanded, a 0-dim value given as one
element in 1 dim, a key dropped (num_batches_tracked among them), an unexpected key, a value of the wrong shape,
its keys sorted or reversed (another order than the model's), loaded with strict True or False from either rank. The returned missing and unexpected keys must be torch's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import strategies as st

from dist_utils import run_ranks
from ranked_hypothesis import examples_on_ranks
from test_load_hypothesis_gloo import FLOATS, same_values
from zoo import DTYPES, bits, fill_random_bytes, same_bits

from coalesced_bcast import load_full_state_dict

EXAMPLES = 80
KINDS = ["linear", "linear", "bn", "custom", "custom", "none_child", "tie", "extra"]


@st.composite
def specs(draw):
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(KINDS))
        linears = [i for i, p in enumerate(parts) if p["kind"] == "linear"]
        if kind == "tie" and not linears:
            kind = "linear"
        p = dict(kind=kind, parent=draw(st.integers(-1, len(parts) - 1)))
        if kind == "linear":
            p.update(inp=draw(st.integers(1, 9)), out=draw(st.integers(1, 9)), bias=draw(st.booleans()),
                     dtype=draw(st.sampled_from(FLOATS)))
        elif kind == "bn":
            p.update(n=draw(st.integers(1, 9)))
        elif kind == "tie":
            p.update(of=draw(st.sampled_from(linears)))
        elif kind == "custom":
            p.update(tensors=[dict(role=draw(st.sampled_from(["param", "buffer", "buffer", "buffer_np", "none"])),
                                   shape=tuple(draw(st.lists(st.integers(0, 6), max_size=3))),
                                   dtype=draw(st.sampled_from(DTYPES)))
                              for _ in range(draw(st.integers(1, 3)))])
        parts.append(p)
    return dict(parts=parts, seed=draw(st.integers(0, 2**31 - 1)), src=draw(st.integers(0, 1)),
                strict=draw(st.booleans()),
                # checkpoint edits, each applied to the key drawn (modulo the keys there are)
                edits=draw(st.lists(st.tuples(st.sampled_from(["cast", "transposed", "expanded", "one_elem", "drop",
                                                               "unexpected", "wrong_shape", "sorted", "reversed"]),
                                              st.integers(0, 63)), max_size=3)))


class _Extra(nn.Module):
    """A module with extra state: a tensor and a number, as get_extra_state returns them."""

    def __init__(self):
        super().__init__()
        self.state = (torch.zeros(3), 0)

    def get_extra_state(self):
        return {"t": self.state[0], "n": self.state[1]}

    def set_extra_state(self, state):
        self.state = (state["t"].clone(), state["n"])


def build(spec, seed: int) -> nn.Module:
    """The module, every tensor's bytes from `seed` (int and bool ones too)."""
    gen = torch.Generator().manual_seed(seed)
    root = nn.Module()
    made: list = []
    for i, p in enumerate(spec["parts"]):
        kind = p["kind"]
        if kind == "linear":
            m = nn.Linear(p["inp"], p["out"], bias=p["bias"], dtype=p["dtype"])
        elif kind == "bn":
            m = nn.BatchNorm1d(p["n"])
        elif kind == "tie":
            src = made[p["of"]]
            m = nn.Linear(src.in_features, src.out_features, bias=False, dtype=src.weight.dtype)
            m.weight = src.weight
        elif kind == "custom":
            m = nn.Module()
            for j, t in enumerate(p["tensors"]):
                if t["role"] == "none":
                    m.register_buffer(f"t{j}", None)
                    continue
                v = torch.empty(t["shape"], dtype=t["dtype"])
                if t["role"] == "param":
                    m.register_parameter(f"t{j}", nn.Parameter(v, requires_grad=v.is_floating_point()))
                else:
                    m.register_buffer(f"t{j}", v, persistent=t["role"] == "buffer")
        elif kind == "extra":
            m = _Extra()
        else:
            m = None
        parent = root if p["parent"] < 0 or made[p["parent"]] is None else made[p["parent"]]
        parent.add_module(f"m{i}", m)
        made.append(m)
    for t in [*root.parameters(), *root.buffers()]:
        fill_random_bytes(t.data, gen)
    for m in root.modules():
        if isinstance(m, _Extra):
            m.state = (torch.randn(3, generator=gen), int(torch.randint(0, 100, (), generator=gen)))
    return root


def checkpoint(spec) -> dict:
    """The source model's state dict (the same on every rank), edited as the spec says."""
    sd = dict(build(spec, spec["seed"] + 1).state_dict())
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    for what, k in spec["edits"]:
        keys = [key for key, v in sd.items() if isinstance(v, torch.Tensor)]
        if not keys:
            break
        key = keys[k % len(keys)]
        v = sd[key]
        if what == "cast" and v.dtype in FLOATS:
            sd[key] = v.to(FLOATS[(FLOATS.index(v.dtype) + 1 + k) % len(FLOATS)])
        elif what == "transposed" and v.dim() == 2:
            sd[key] = v.t().contiguous().t()  # the same values, stored column by column
        elif what == "expanded" and v.dim() >= 1 and v.shape[0] > 0:
            sd[key] = v[:1].expand(v.shape)  # stride 0 along dim 0
        elif what == "one_elem" and v.dim() == 0:
            sd[key] = v.reshape(1)  # torch 0.3's scalars: one element in 1 dim, into a 0-dim tensor
        elif what == "drop":
            del sd[key]
        elif what == "unexpected":
            sd["zz_unexpected.weight"] = torch.randn(2, generator=gen)
        elif what == "wrong_shape":
            bad = torch.empty(v.shape + (2,), dtype=v.dtype)
            bits(bad).fill_(3)  # (torch 2.4 cannot fill float8 tensors)
            sd[key] = bad
        elif what == "sorted":  # a safetensors file's order, not the model's
            sd = dict(sorted(sd.items()))
        elif what == "reversed":
            sd = dict(reversed(list(sd.items())))
    return sd


def _tensors(module: nn.Module) -> dict:
    return {n: t.detach().clone() for n, t in [*module.named_parameters(remove_duplicate=False),
                                               *module.named_buffers(remove_duplicate=False)]}


def _extras(module: nn.Module) -> dict:
    return {n: (m.state[0].clone(), m.state[1]) for n, m in module.named_modules() if isinstance(m, _Extra)}


def run_example(rank: int, spec) -> bool:
    sd = checkpoint(spec)
    ref = build(spec, 7 + rank)
    try:
        result = ref.load_state_dict(sd, strict=spec["strict"])
        want = ("ok", sorted(result.missing_keys), sorted(result.unexpected_keys))
    except Exception as e:  # noqa: BLE001 - compared below
        want = ("raised", f"{type(e).__name__}: {e}")
    model = build(spec, 7 + rank)
    before = _tensors(model)
    try:
        stats = load_full_state_dict(model, sd if rank == spec["src"] else None, src=spec["src"], strict=spec["strict"],
                                     bucket_bytes=4096)
        got = ("ok", sorted(stats.missing_keys), sorted(stats.unexpected_keys))
    except Exception as e:  # noqa: BLE001 - compared below
        got = ("raised", f"{type(e).__name__}: {e}")
    problems = []
    if want[0] != got[0] or (want[0] == "ok" and want != got):
        problems.append(f"torch's load_state_dict: {want}; load_full_state_dict: {got}")
    elif got[0] == "ok":
        mine, theirs = _tensors(model), _tensors(ref)
        cast = {k for k, v in sd.items() if isinstance(v, torch.Tensor) and k in theirs and v.dtype != theirs[k].dtype}
        wrong = [n for n in theirs if not (same_values if n in cast else same_bits)(mine[n], theirs[n])]
        if wrong:
            problems.append(f"differs from torch's load at {wrong}")
        e_mine, e_theirs = _extras(model), _extras(ref)
        if any(not torch.equal(e_mine[n][0], e_theirs[n][0]) or e_mine[n][1] != e_theirs[n][1] for n in e_theirs):
            problems.append("extra state differs")
    else:
        after = _tensors(model)
        if any(not same_bits(after[n], before[n]) for n in before):
            problems.append(f"raised ({got[1][:200]}) after writing")
    for p in problems:
        print(f"rank {rank}: {p}", flush=True)
    return not problems


def _body(rank, world_size, out_dir):
    explicit = [dict(parts=[dict(kind="bn", parent=-1, n=3), dict(kind="linear", parent=0, inp=2, out=3, bias=True,
                                                                   dtype=torch.float32),
                            dict(kind="tie", parent=-1, of=1), dict(kind="none_child", parent=-1),
                            dict(kind="extra", parent=1)],
                     seed=5, src=1, strict=False, edits=[("drop", 2), ("cast", 3), ("unexpected", 0)]),
                dict(parts=[dict(kind="linear", parent=-1, inp=2, out=3, bias=True, dtype=torch.float32),
                            dict(kind="bn", parent=0, n=2), dict(kind="tie", parent=-1, of=0)],
                     seed=6, src=0, strict=True, edits=[("reversed", 0), ("cast", 1)])]
    examples_on_ranks(rank, specs(), lambda spec: run_example(rank, spec), EXAMPLES, out_dir, explicit)
    dist.barrier()


def test_load_full_state_dict_matches_load_state_dict_on_random_modules(tmp_path):
    run_ranks(2, _body, str(tmp_path), timeout=600)
    assert int((tmp_path / "count").read_text()) >= EXAMPLES

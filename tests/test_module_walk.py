"""The C++ walks of a module (csrc/module_walk.h) against torch's own walk and against walk_modules_reference,
the load's walk written out in Python."""
import functools
import types
from collections import OrderedDict
from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn

from coalesced_bcast import _C
from coalesced_bcast.sync import _module_slots, module_states

EXTRA = getattr(nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")


def _from_torch(fn) -> bool:
    """Whether a method is torch's own (defined in the torch package)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    where = fn.__module__ if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) else type(fn).__module__
    return isinstance(where, str) and (where == "torch" or where.startswith("torch."))


def walk_modules_reference(model: nn.Module):
    """_C.load_walk's result computed in Python, as state_dict() walks: (extra-state keys -> modules, ids of
    the parameters and buffers, (prefix, module) of each module with load pre-hooks or a
    _load_from_state_dict defined outside torch)."""
    base = nn.Module.get_extra_state
    extra, owned, custom = {}, set(), []

    def walk(m: nn.Module, prefix: str) -> None:
        owned.update(id(t) for t in m._parameters.values() if t is not None)
        owned.update(id(t) for t in m._buffers.values() if t is not None)
        if type(m).get_extra_state is not base:
            extra[prefix + EXTRA] = m
        if getattr(m, "_load_state_dict_pre_hooks", None) or not _from_torch(type(m)._load_from_state_dict):
            custom.append((prefix, m))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return extra, _C.IdSet(owned), custom


class Block(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # buffers, num_batches_tracked among them
        self.shared = shared  # the same module under several parents
        self.gone = None  # a child set to None
        self.register_parameter("absent", None)
        self.register_buffer("empty_buf", None)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4, bias=False)
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block(shared) for _ in range(3)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two names
        self.experts = nn.ModuleList([nn.ModuleDict({"w1": nn.Linear(4, 2), "w2": nn.Linear(2, 4)})
                                      for _ in range(4)])


def torch_walk(m: nn.Module, include_buffers: bool, dedupe: bool) -> list:
    out = [t for _, t in m.named_parameters(remove_duplicate=dedupe)]
    if include_buffers:
        out += [b for _, b in m.named_buffers(remove_duplicate=dedupe) if b is not None]
    return out


@pytest.mark.parametrize("include_buffers", [True, False])
@pytest.mark.parametrize("dedupe", [False, True])
def test_walk_is_torchs_order_with_ties_and_shared_modules(include_buffers, dedupe):
    m = Model()
    found = _C.module_slots(m, include_buffers, dedupe)
    assert found is not None
    owners, keys, tensors = found
    expected = torch_walk(m, include_buffers, dedupe)
    assert len(tensors) == len(expected)
    assert all(a is b for a, b in zip(tensors, expected))
    assert all(d[k] is t for d, k, t in zip(owners, keys, tensors))
    # The Python walk (taken where names are wanted) gives the same slots.
    py_owners, py_keys, py_tensors = _module_slots(m, include_buffers, dedupe=dedupe, names=[])
    assert [id(d) for d in owners] == [id(d) for d in py_owners] and keys == py_keys
    assert all(a is b for a, b in zip(tensors, py_tensors))
    if not dedupe:  # tied names kept: the shared module's weight three times, the tied embedding twice
        assert sum(t is m.blocks[0].shared.weight for t in tensors) == 3
        assert sum(t is m.embed.weight for t in tensors) == 2
        assert len(module_states(m, include_buffers)[0]) == len(tensors)  # the names errors word line up


class Frozen(Mapping):
    """A mapping that is not a dict: torch's walks read it through .items()."""

    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_ordered_dicts_in_their_order_and_other_mappings_in_python():
    m = Model()
    m.blocks[1].proj._parameters = OrderedDict(m.blocks[1].proj._parameters)  # torch < 2.5 keeps these
    m.blocks[1].proj._parameters.move_to_end("weight")  # bias first now, as .items() gives it
    found = _C.module_slots(m, True, False)
    assert found is not None
    assert [id(t) for t in found[2]] == [id(t) for t in torch_walk(m, True, False)]
    m.blocks[2].proj._parameters = Frozen(m.blocks[2].proj._parameters)
    assert _C.module_slots(m, True, False) is None
    tensors = _module_slots(m, True)[2]  # the Python walk
    assert [id(t) for t in tensors] == [id(t) for t in torch_walk(m, True, False)]


def test_a_module_without_children_or_state():
    assert _C.module_slots(nn.Identity(), True, False) == ([], [], [])
    p = nn.Parameter(torch.ones(3))
    m = nn.ParameterList([p, p])  # one tensor under two names
    assert [t is p for t in _C.module_slots(m, True, False)[2]] == [True, True]
    assert [t is p for t in _C.module_slots(m, True, True)[2]] == [True]


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def get_extra_state(self):
        return {"step": 3}

    def set_extra_state(self, state):
        self.state = state


def test_load_walk_is_state_dicts_walk():
    from coalesced_bcast.state_dict import _walk_modules
    m = Model()
    shared = WithExtra()
    m.blocks[0].extra = shared
    m.blocks[2].extra = shared  # reached by two paths: two keys, as state_dict() has them
    root = nn.Sequential(m, WithExtra())
    found = _C.load_walk(root, nn.Module.get_extra_state, EXTRA)
    assert found is not None
    extra, owned, custom = found
    assert custom == []  # no load logic of its own anywhere
    sd_extra = [k for k in root.state_dict() if k.endswith(EXTRA)]
    assert sorted(extra) == sorted(sd_extra) == sorted(["0.blocks.0.extra._extra_state",
                                                        "0.blocks.2.extra._extra_state", "1._extra_state"])
    assert extra["0.blocks.2.extra._extra_state"] is shared
    every = [t for _, t in root.named_parameters(remove_duplicate=False)]
    every += [b for _, b in root.named_buffers(remove_duplicate=False)]
    assert owned.to_set() == {id(t) for t in every} and len(owned) == len({id(t) for t in every})
    assert all(id(v) in owned for v in root.state_dict(keep_vars=True).values() if isinstance(v, torch.Tensor))
    other = torch.zeros(1)
    assert id(other) not in owned and "x" not in owned
    again = _walk_modules(root)
    assert again[0] == extra and again[1].to_set() == owned.to_set()
    ref_extra, ref_owned, ref_custom = walk_modules_reference(root)
    assert ref_extra == extra and ref_owned.to_set() == owned.to_set() and ref_custom == custom


class OwnLoader(nn.Linear):
    def _load_from_state_dict(self, *args, **kwargs):
        return super()._load_from_state_dict(*args, **kwargs)


def test_load_walk_finds_load_logic_of_its_own():
    m = Model()
    m.blocks[1].norm._register_load_state_dict_pre_hook(lambda *a, **k: None)
    m.experts[2]["w1"] = OwnLoader(4, 2)
    found = _C.load_walk(m, nn.Module.get_extra_state, EXTRA)
    assert [p for p, _ in found[2]] == ["blocks.1.norm.", "experts.2.w1."]
    ref = walk_modules_reference(m)
    assert found[0] == ref[0] and found[1] == ref[1] and found[2] == ref[2]


def test_id_set_holds_exactly_its_ids():
    objs = [torch.empty(0) for _ in range(5000)]  # past many a growth of the table
    s = _C.IdSet(id(o) for o in objs[::2])
    assert len(s) == 2500
    assert all(id(o) in s for o in objs[::2])
    assert not any(id(o) in s for o in objs[1::2])
    assert s.to_set() == {id(o) for o in objs[::2]}
    assert len(_C.IdSet([id(objs[0]), id(objs[0])])) == 1
    assert 0 not in _C.IdSet([0]) and len(_C.IdSet(())) == 0


def test_load_walk_reads_other_mappings():
    from coalesced_bcast.state_dict import _walk_modules
    m = Model()
    m.head._buffers = OrderedDict()  # read in C++, as a dict
    assert _C.load_walk(m, nn.Module.get_extra_state, EXTRA) == walk_modules_reference(m)
    m.head._buffers = Frozen({})
    m.blocks[0].proj._parameters = Frozen(m.blocks[0].proj._parameters)  # read through .items()
    found = _C.load_walk(m, nn.Module.get_extra_state, EXTRA)
    assert found is not None and found == walk_modules_reference(m)
    assert id(m.embed.weight) in found[1] and id(m.blocks[0].proj.weight) in found[1]
    m.head._buffers = 3  # not a mapping: no walk
    assert _C.load_walk(m, nn.Module.get_extra_state, EXTRA) is None
    with pytest.raises(TypeError, match="the module walk cannot read this model"):
        _walk_modules(m)  # the load has one walk, the C++ one: it says why it cannot read this model

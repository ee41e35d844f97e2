"""Random models loaded with load_full_state_dict over gloo in ONE 2-rank process group, bitwise.

Each example: plain tensors and, where this torch has DTensor in public (>= 2.5), DTensors (Replicate, Shard(d), uneven and empty shards, on a 1-D mesh of
both ranks and on 1x2 and 2x1 meshes, the same dim sharded twice) or a model that FSDP2 shards (where this
torch has it on CPU), parameters and buffers, ties (one
tensor under two keys: the last key's value wins), checkpoint values that are views (transposed, strided,
offset, expanded) or one tensor under two keys, checkpoint dtypes other than the model's (cast as
``copy_`` casts), keys in another order, small buckets that split tensors. Every rank's local tensors
must hold, bit for bit, ``torch.empty(shape, dtype).copy_(value)``'s box for that rank (where the value is
cast, a NaN may be another NaN: see same_values). In a fifth of the
examples one checkpoint value has the wrong shape: every rank must raise, naming its key, with every tensor
as it was.

Each example runs on both ranks (ranked_hypothesis.py): each builds the model (poisoned) and the checkpoint
(the same bytes on every rank, handed to the load by the source only), loads and compares.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import strategies as st

from dist_utils import run_ranks
from ranked_hypothesis import examples_on_ranks
from zoo import DTYPES, fill_random_bytes, same_bits

try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    HAVE_DTENSOR = True
except ImportError:  # torch < 2.5: DTensor only under a private name; plain tensors only here
    HAVE_DTENSOR = False

    class DTensor:  # noqa: D101 - nothing is one here
        pass
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6: no public FSDP2, and on CPU none at all
    fully_shard = None

from coalesced_bcast.state_dict import load_full_state_dict

EXAMPLES = 120
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
MESHES = ["1d", "1x2", "2x1", "plain"]  # "plain": not a DTensor
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded"]


@st.composite
def specs(draw):
    entries = []
    # FSDP2 (fully_shard over both ranks) shards the plain tensors itself: Shard(0), padded storage, post-hooks.
    fsdp2 = fully_shard is not None and draw(st.integers(0, 2)) == 0
    meshes = ["plain"] if fsdp2 or not HAVE_DTENSOR else MESHES
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["new", "new", "new", "tie", "same_value"]))
        if kind != "new" and not entries:
            kind = "new"
        if kind == "tie":  # an earlier entry's tensor under another key
            entries.append(dict(kind=kind, of=draw(st.integers(0, len(entries) - 1))))
            continue
        if kind == "same_value":  # a new tensor whose checkpoint value is an earlier entry's value object
            of = draw(st.integers(0, len(entries) - 1))
            while entries[of]["kind"] != "new":
                of = entries[of]["of"]
            base = entries[of]
            model_dtype = draw(st.sampled_from(_cast_targets(base["ckpt_dtype"])))
            entries.append(dict(kind=kind, of=of, shape=base["shape"], ckpt_dtype=base["ckpt_dtype"],
                                model_dtype=model_dtype, mesh=draw(st.sampled_from(meshes)),
                                placements=draw(_placements(len(base["shape"]))),
                                buffer=draw(st.booleans())))
            continue
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 40)), min_size=ndim, max_size=ndim)))
        ckpt = draw(st.sampled_from(list(range(len(DTYPES)))))
        ckpt_dtype = DTYPES[ckpt]
        entries.append(dict(kind=kind, shape=shape, ckpt_dtype=ckpt_dtype,
                            model_dtype=draw(st.sampled_from(_cast_targets(ckpt_dtype))),
                            mesh=draw(st.sampled_from(meshes)), placements=draw(_placements(ndim)),
                            layout=draw(st.sampled_from(LAYOUTS)), buffer=draw(st.booleans())))
    # One checkpoint value of a wrong shape in a fifth of the examples: refused on every rank, nothing written.
    news = [i for i, e in enumerate(entries) if e["kind"] == "new"]
    broken = draw(st.sampled_from(news)) if draw(st.integers(0, 4)) == 0 else None
    return dict(entries=entries, src=draw(st.integers(0, 1)), seed=draw(st.integers(0, 9999)),
                shuffle=draw(st.booleans()), fsdp2=fsdp2, broken=broken,
                # odd multiples of 16 too: tensors then end on and straddle bucket ends at other places
                options=dict(bucket_bytes=draw(st.one_of(st.sampled_from([4096, 8192, 1 << 16]),
                                                         st.integers(256, 1024).map(lambda n: 16 * n))),
                             ring_depth=draw(st.integers(1, 3))))


def _cast_targets(dtype: torch.dtype) -> list[torch.dtype]:
    """The model dtypes a checkpoint value of `dtype` is drawn into: its own, or one copy_ casts it to without
    undefined behaviour (no float into an integer: NaN has no integer value)."""
    if dtype in FLOATS:
        return [dtype] + [d for d in FLOATS if d != dtype]
    if dtype in INTS:
        return [dtype] + [d for d in INTS + FLOATS if d != dtype]
    return [dtype]


def _placements(ndim: int):
    """Two placements (the second used on the 2-D meshes): Replicate or Shard of a dim the tensor has."""
    one = st.sampled_from(["R"] + [f"S{d}" for d in range(ndim)])
    return st.tuples(one, one)


def _placement(p: str):
    return Replicate() if p == "R" else Shard(int(p[1:]))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


def _value(shape, dtype, layout, gen) -> torch.Tensor:
    """A checkpoint value of `shape` with random bytes, laid out as `layout` says (a view where it can be)."""
    def fresh(s):
        t = torch.empty(s, dtype=dtype)
        fill_random_bytes(t, gen)
        return t
    if layout == "transposed" and len(shape) >= 2:
        return fresh(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "strided" and len(shape) >= 1:
        return fresh(shape[:-1] + (2 * shape[-1] + 1,))[..., 1::2]
    if layout == "expanded" and len(shape) >= 1:
        return fresh((1,) + shape[1:]).expand(shape)
    if layout == "offset":
        n = 1
        for s in shape:
            n *= s
        return fresh((n + 3,))[3:].view(shape)
    return fresh(shape)


def build(spec, rank: int, meshes: dict):
    """(model with poisoned tensors, checkpoint on every rank, key -> expected tensor on this rank)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    poison = torch.Generator().manual_seed(7919 + rank)
    model = nn.Module()
    tensors, values, keys = [], [], []
    for i, e in enumerate(spec["entries"]):
        name = f"t{i}"
        if e["kind"] == "tie":
            t = tensors[e["of"]]
            value = _value(tuple(t.shape), _ckpt_dtype_of(spec, e["of"]), "contiguous", gen)
        else:
            shape, dtype = e["shape"], e["model_dtype"]
            if e["mesh"] == "plain":
                t = torch.empty(shape, dtype=dtype)
                fill_random_bytes(t, poison)
            else:
                mesh = meshes[e["mesh"]]
                placements = [_placement(p) for p in e["placements"][:mesh.ndim]]
                lshape, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
                local = torch.empty(tuple(lshape), dtype=dtype)
                fill_random_bytes(local, poison)
                t = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                       stride=_contiguous_strides(shape))
            if e["kind"] == "same_value":
                value = values[e["of"]]
            else:
                # (2, 2) more: torch before 2.5 loads a 1-dim value of any length into a 0-dim tensor
                value = _value(shape + ((2, 2) if i == spec["broken"] else ()), e["ckpt_dtype"], e["layout"], gen)
        as_param = not e.get("buffer", True) and (t.dtype.is_floating_point or t.dtype.is_complex) and \
            not (spec["fsdp2"] and t.dim() == 0)  # FSDP2 shards no 0-dim parameter
        if isinstance(t, nn.Parameter) if e["kind"] == "tie" else as_param:
            t = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
            model.register_parameter(name, t)
        else:
            model.register_buffer(name, t)
        tensors.append(t)
        values.append(value)
        keys.append(name)
    if spec["fsdp2"]:
        fully_shard(model, mesh=meshes["1d"])
    # Expected: load_state_dict's order of copies (the model's state_dict order; ties: the last key wins).
    expected: dict[int, torch.Tensor] = {}
    cast: dict[int, bool] = {}
    value_of = dict(zip(keys, values))
    for k, t in model.state_dict(keep_vars=True).items():
        if spec["broken"] is not None:  # refused: every tensor as it was
            expected[id(t)] = (t.to_local() if isinstance(t, DTensor) else t.detach()).clone()
            continue
        full = torch.empty(tuple(t.shape), dtype=t.dtype)
        full.copy_(value_of[k])
        if isinstance(t, DTensor):
            lshape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            full = full[tuple(slice(o, o + n) for o, n in zip(off, lshape))]
            if full.numel() == 0:  # no bytes, any shape: FSDP2 gives a (1, 0) parameter's rank 0 a (0, 0) shard
                full = full.new_empty(t.to_local().shape)
        expected[id(t)] = full
        cast[id(t)] = value_of[k].dtype != t.dtype  # the last key's value decides, as its copy is the one kept
    sd = dict(zip(keys, values))
    if spec["shuffle"]:
        order = torch.randperm(len(keys), generator=gen).tolist()
        sd = {keys[j]: values[j] for j in order}
    return model, sd, expected, cast


def _ckpt_dtype_of(spec, i: int) -> torch.dtype:
    e = spec["entries"][i]
    while e["kind"] == "tie":
        e = spec["entries"][e["of"]]
    return e["ckpt_dtype"]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, but that a NaN may be any NaN: where a value is cast, torch's CPU copy_ encodes NaNs one way in
    its vectorized body and another in its scalar tail (float32 -> bfloat16: 0xFFFF against 0x7FC0; a float16
    signaling NaN into float32: quieted or not), and which elements fall where follows torch's own iteration
    order over the source's memory; the load casts its pieces in the tensor's row-major order, bucket by bucket."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return same_bits(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and same_bits(a[~nan_a], b[~nan_b])


def run_example(rank: int, spec, meshes: dict) -> bool:
    model, sd, expected, cast = build(spec, rank, meshes)
    broken = spec["broken"]
    try:
        load_full_state_dict(model, sd if rank == spec["src"] else None, src=spec["src"], **spec["options"])
        if broken is not None:
            print(f"rank {rank}: a checkpoint value of the wrong shape for 't{broken}' loaded", flush=True)
            return False
    except Exception as e:  # noqa: BLE001 - reported through the shared verdict
        if broken is None or f"t{broken}" not in str(e):
            print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
            return False
    ok = True
    for k, t in model.state_dict(keep_vars=True).items():
        got = t.to_local() if isinstance(t, DTensor) else t.detach()
        same = same_values(got, expected[id(t)]) if cast.get(id(t)) else same_bits(got, expected[id(t)])
        if not same:
            print(f"rank {rank}: '{k}' differs: got {got.flatten()[:4]} expected {expected[id(t)].flatten()[:4]}",
                  flush=True)
            ok = False
    return ok


def _body(rank, world_size, out_dir, examples=EXAMPLES):
    meshes = {"1d": init_device_mesh("cpu", (2,)), "1x2": init_device_mesh("cpu", (1, 2)),
              "2x1": init_device_mesh("cpu", (2, 1))} if HAVE_DTENSOR else {}
    examples_on_ranks(rank, specs(), lambda spec: run_example(rank, spec, meshes), examples, out_dir)


def test_random_loads_bitwise(tmp_path):
    run_ranks(2, _body, str(tmp_path), timeout=400)
    assert int((tmp_path / "count").read_text()) >= EXAMPLES

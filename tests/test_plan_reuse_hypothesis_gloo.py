"""Kept plans on random tensor lists (test_hypothesis_gloo's: views, ties, aliases, strided, every dtype) over
gloo in ONE 2-rank group, run again and again while the source's values change, and now and then a tensor
re-allocated on one rank or resized on every rank: a run after such a change raises AgreementError on every
rank with nothing written anywhere, and run(replan=True) then sends the source's bytes, bit for bit.
Each example runs on both ranks (ranked_hypothesis.py)."""
import torch
from hypothesis import strategies as st

import coalesced_bcast
from dist_utils import run_ranks
from ranked_hypothesis import examples_on_ranks
from test_hypothesis_gloo import build, specs as tensor_specs
from zoo import fill_random_bytes, same_bits

EXAMPLES = 60
# replan: a tensor re-allocated on every rank, then run(replan=True) at once (no refused run first): with
# speculate, what every rank sent before the agreement is void and sent again.
CHANGES = ["none", "none", "realloc", "resize", "replan"]


@st.composite
def specs(draw):
    spec = draw(tensor_specs())
    verify = spec["options"].pop("verify")
    # Per run: a change made before it (which tensor, on which rank), and whether to verify.
    spec["runs"] = draw(st.lists(st.tuples(st.sampled_from(CHANGES), st.integers(0, 99), st.integers(0, 1),
                                           st.booleans()), min_size=1, max_size=4))
    spec["verify"] = verify
    spec["options"]["speculate"] = draw(st.booleans())
    return spec


def _fill(tensors, gen):
    """New random bytes into every tensor, in list order (views and aliases: the later write wins, on every copy
    of the structure alike)."""
    for t in tensors:
        if t.numel():
            fresh = torch.empty(t.shape, dtype=t.dtype)
            fill_random_bytes(fresh, gen)
            t.copy_(fresh)


def _can_resize(tensors, index: int) -> bool:
    """A contiguous tensor that is no view and shares its memory with no other entry (a shrunk tensor beside a
    view of its old extent would overlap it: refused as bad input, rightly)."""
    t = tensors[index % len(tensors)]
    ptr = t.untyped_storage().data_ptr()
    alone = sum(u.untyped_storage().data_ptr() == ptr for u in tensors) == 1
    return t._base is None and t.is_contiguous() and t.numel() > 1 and alone


def _change(tensors, kind: str, index: int) -> bool:
    """Re-allocate (.data replaced) or resize (resize_, contiguous tensors that are no view) tensor `index`;
    False where there is nothing to change."""
    if not tensors:
        return False
    t = tensors[index % len(tensors)]
    if kind == "realloc":
        t.data = t.data.clone()
        return True
    if kind == "resize" and _can_resize(tensors, index):
        t.resize_(1)
        return True
    return False


def run_example(rank: int, spec) -> bool:
    src = spec["src"]
    tensors = build(spec, 5000 + 7 * rank + spec["seed"])
    expect = build(spec, 5000 + 7 * src + spec["seed"])
    ok = True
    try:
        plan = coalesced_bcast.plan_sync(tensors, src=src, **spec["options"])
        for step, (kind, index, on_rank, verify) in enumerate(spec["runs"]):
            seed = spec["seed"] * 100 + step
            # A change on one rank (realloc) or on every rank (resize): the next run is refused everywhere. Then
            # every rank (and the expected copy) holds the same change, so that the structure every rank replans
            # is one (a re-allocated tensor's views and aliases stay on the old memory, on every rank alike).
            if kind == "replan" and tensors:
                _change(tensors, "realloc", index)
                _change(expect, "realloc", index)
            changed = bool(tensors) and kind not in ("none", "replan") and (kind == "realloc" or
                                                                          _can_resize(tensors, index))
            if changed and (kind == "resize" or rank == on_rank):
                _change(tensors, kind, index)
            if rank == src:
                _fill(tensors, torch.Generator().manual_seed(seed))
            if changed:
                before = [t.clone() for t in tensors]
                try:
                    plan.run(verify=verify, timeout=60)
                except coalesced_bcast.AgreementError:
                    pass
                else:
                    print(f"rank {rank}: run {step} after a {kind} was not refused", flush=True)
                    return False
                if not all(same_bits(t, b) for t, b in zip(tensors, before)):
                    print(f"rank {rank}: a refused run {step} wrote something", flush=True)
                    return False
                if kind == "realloc" and rank != on_rank:
                    _change(tensors, kind, index)
                _change(expect, kind, index)
            _fill(expect, torch.Generator().manual_seed(seed))
            if rank == src and changed:  # the source's values as the expected copy has them, after the change
                _fill(tensors, torch.Generator().manual_seed(seed))
            plan.run(verify=verify, replan=changed or kind == "replan", timeout=60)
            wrong = [i for i, (t, e) in enumerate(zip(tensors, expect)) if not same_bits(t, e)]
            if wrong:  # recorded, not returned: the other rank makes the next run too
                print(f"rank {rank}: run {step} ({kind}): tensors {wrong} differ from the source's", flush=True)
                ok = False
    except Exception as e:  # noqa: BLE001 - reported through the shared verdict
        print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
        return False
    return ok


def _body(rank, world_size, out_dir, examples=EXAMPLES):
    examples_on_ranks(rank, specs(), lambda spec: run_example(rank, spec), examples, out_dir)


def test_kept_plans_on_random_tensors_refuse_changes_and_replan(tmp_path):
    run_ranks(2, _body, str(tmp_path), timeout=400)
    assert int((tmp_path / "count").read_text()) >= EXAMPLES

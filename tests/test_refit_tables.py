"""A refit's copy tables without any communication: every trainer rank's pack (its rows, cast to the
wire's dtype, into its chunk or the slot) and the sender's permute (the gathered chunks into the slot)
must rebuild exactly the stream the receivers' load plan reads, for uneven row splits, 1-D and 0-dim
tensors, casts and tensors larger than a bucket. On the CPU and, where there is one, a GPU (the CUDA
pack kernel's casts must match torch's own CUDA copy_ bit for bit)."""
import pytest
import torch

from coalesced_bcast import _C
from coalesced_bcast._util import _dtype_code
from zoo import fill_random_bytes, same_bits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _C.with_cuda else [])


def _state(gen):
    shapes = [((37, 24), torch.float32), ((5, 3), torch.float32), ((300, 16), torch.float32), ((16,), torch.float32),
              ((), torch.float32), ((7, 2, 3), torch.int64), ((3,), torch.bool), ((1, 1000), torch.float32),
              ((0, 4), torch.float32), ((9, 5), torch.float16), ((2, 2049), torch.bfloat16)]
    out = []
    for shape, dtype in shapes:
        t = torch.empty(shape, dtype=dtype)
        fill_random_bytes(t, gen)
        out.append(t)
    return out


def _units(shapes) -> torch.Tensor:
    """The stream's units table (dtype code, dims, sizes) of (shape, wire dtype) pairs."""
    units = torch.zeros((len(shapes), 10), dtype=torch.int64)
    for i, (shape, dtype) in enumerate(shapes):
        units[i, 0], units[i, 1] = _dtype_code(dtype), len(shape)
        units[i, 2:2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return units


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world,sender", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_packs_and_permutes_rebuild_the_stream(device, world, sender):
    gen = torch.Generator().manual_seed(world * 10 + sender)
    full = [t.to(device) for t in _state(gen)]
    device = full[0].device  # with its index: the plan compares devices exactly
    wire = [torch.bfloat16 if t.is_floating_point() and t.dtype == torch.float32 else t.dtype for t in full]
    # 0-dim and bool tensors are held whole by the sender (mode 0); the rest are split by rows.
    modes = [0 if t.dim() == 0 or t.dtype == torch.bool else 1 for t in full]
    units = _units([(t.shape, w) for t, w in zip(full, wire)])
    B = 4096
    plans, held = [], []  # the plans point into the local tensors: keep them
    for r in range(world):
        locals_ = [(t.chunk(world, 0)[r] if r < len(t.chunk(world, 0)) else t[:0]).contiguous() if m == 1 and world > 1
                   else (t if r == sender else torch.Tensor()) for t, m in zip(full, modes)]
        plans.append(_C.refit_plan(units, locals_, modes, r, world, sender, B, 2, r, device,
                                   [f"t{i}" for i in range(len(full))]))
        held.append(locals_)
    rows = _C.bucket_units(units, B, True)
    views = _C.SlotViews(units, rows, [f"t{i}" for i in range(len(full))])
    chunk_bytes = _C._refit_chunk_bytes(plans[sender])
    load = _C.load_plan(units, [], [], torch.zeros((0, 9), dtype=torch.int64), B, 2, 0, 1, device,
                        whole_units=True)
    assert plans[sender].num_buckets == load.num_buckets
    for k in range(plans[sender].num_buckets):
        cb = chunk_bytes[k]
        gathered = torch.zeros(world * cb, dtype=torch.uint8, device=device)
        for r in range(world):
            if r != sender and cb:
                _C._refit_copy(plans[r], k, False, gathered, gathered[r * cb:(r + 1) * cb])
        slot = torch.zeros(plans[sender].slot_bytes, dtype=torch.uint8, device=device)
        _C._refit_copy(plans[sender], k, False, slot, slot)
        if world > 1 and cb:
            _C._refit_copy(plans[sender], k, True, gathered, slot)
        mine = rows[rows[:, 0] == k]
        # a callback's batch: whole tensors as (name, shaped view), the rest as pieces with their place
        pairs, pieces = views.batch(k, slot)
        whole = [(u, first, count) for _, u, first, count, _ in mine.tolist() if first == 0 and count == full[u].numel()]
        assert [n for n, _ in pairs] == [f"t{u}" for u, _, _ in whole]
        assert all(v.shape == full[u].shape for (_, v), (u, _, _) in zip(pairs, whole))
        assert [(n, f, tuple(s)) for n, _, f, s in pieces] == [
            (f"t{u}", first, tuple(full[u].shape)) for _, u, first, count, _ in mine.tolist()
            if not (first == 0 and count == full[u].numel())]
        for (_, u, first, count, _), view in zip(mine.tolist(), views.views(k, slot)):
            want = full[u].to(wire[u]).reshape(-1)[first:first + count]
            assert same_bits(view.reshape(-1), want), f"bucket {k}: tensor {u} elements {first}..{first + count}"
    # Every element of every tensor is in exactly one bucket's rows.
    counts = [0] * len(full)
    for _, u, _, c, _ in rows.tolist():
        counts[u] += c
    assert counts == [t.numel() for t in full]


def test_a_rank_whose_rows_do_not_match_is_refused_naming_the_tensor():
    units = torch.zeros((1, 10), dtype=torch.int64)
    units[0, :4] = torch.tensor([_dtype_code(torch.float32), 2, 7, 3])
    with pytest.raises(ValueError, match=r"tensor 0 \('w'\) on trainer rank 1.*12 elements.*rows \[4, 7\)"):
        _C.refit_plan(units, [torch.zeros(4, 3)], [1], 1, 2, 0, 4096, 2, 1, torch.device("cpu"), ["w"])


def test_an_empty_tensor_on_a_bucket_boundary_opens_no_bucket():
    """A refit keeps every tensor that fits in a bucket whole in one; an empty one, after a tensor that ends
    exactly on a bucket's end, crosses nothing and stays there. (Moved to the next multiple, it opened a
    bucket of 0 bytes that every receiver's plan refused: found by a seeded hypothesis hunt.)"""
    B = 4096
    shapes = [((16,), torch.float64), ((496,), torch.float64), ((0, 3), torch.float32), ((), torch.int8)]
    units = _units(shapes)
    # (16 + 496) x 8 bytes fill one bucket exactly; the int8 after the empty tensor starts a second
    for end, want in ((2, 1), (3, 1), (4, 2)):
        u = units[:end]
        load = _C.load_plan(u, [], [], torch.zeros((0, 9), dtype=torch.int64), B, 2, 0, 1, torch.device("cpu"),
                            whole_units=True)
        assert load.num_buckets == want, (end, load.num_buckets)
        assert sorted(set(_C.bucket_units(u, B, True)[:, 0].tolist())) == list(range(want))
        locals_ = [torch.zeros(s, dtype=d) for s, d in shapes[:end]]
        sender = _C.refit_plan(u, locals_, [0] * end, 0, 1, 0, B, 2, 0, torch.device("cpu"),
                               [f"t{i}" for i in range(end)])
        assert sender.num_buckets == want


def test_a_load_plan_checks_its_destinations_only_when_kept():
    """A one-shot load's plan does not take its destinations' keys (a pass over every tensor that only a kept
    plan needs); asked to check them anyway, it refuses rather than find nothing changed."""
    units = torch.zeros((1, 10), dtype=torch.int64)
    units[0, 0], units[0, 1], units[0, 2] = _dtype_code(torch.float32), 1, 8
    dest = torch.zeros(8)
    meta = torch.zeros((1, 9), dtype=torch.int64)
    kept = _C.load_plan(units, [], [dest], meta, 4096, 2, 0, 1, torch.device("cpu"), kept=True)
    assert kept.check_unchanged() == ""
    dest.resize_(16)  # re-allocated: the kept plan's tables would point into freed memory
    assert "re-allocated" in kept.check_unchanged() or "changed shape" in kept.check_unchanged()
    once = _C.load_plan(units, [], [torch.zeros(8)], meta, 4096, 2, 0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without kept=True"):
        once.check_unchanged()


def test_tensor_lists_carry_a_load_sources_between_calls():
    """describe_tensors hands its converted tensors on as a TensorList: take() reorders them (the units'
    order), load_plan takes them out of it, and a row past its end raises instead of reading past it."""
    cpu = torch.device("cpu")
    sources = [torch.arange(4, dtype=torch.float32), torch.ones(3, 5, dtype=torch.float16), torch.zeros(7, dtype=torch.int64)]
    table, canon, problems, held = _C.describe_tensors(sources, cpu)
    assert problems == [] and len(held) == 3 and canon.tolist() == [0, 1, 2]
    order = torch.tensor([2, 0], dtype=torch.int64)
    taken = held.take(order)
    assert len(taken) == 2 and len(held) == 3
    with pytest.raises(IndexError, match="row 3 of a list of 3"):
        held.take(torch.tensor([3], dtype=torch.int64))
    plan = _C.load_plan(table[order], taken, [], torch.zeros((0, 9), dtype=torch.int64), 4096, 2, 0, 1, cpu)
    assert len(taken) == 0  # the plan holds them now
    assert plan.num_units_sent == 2 and plan.total_bytes == 7 * 8 + 4 * 4
    with pytest.raises(ValueError, match="checkpoint tensor 0 on source rank 0 is Long of 7 elements"):
        _C.load_plan(table[:1], held.take(order[:1]), [], torch.zeros((0, 9), dtype=torch.int64), 4096, 2, 0, 1, cpu)


def test_describe_tensors_in_chunks_finds_ties_and_problems_across_chunks():
    """describe_tensors reads a large list in chunks on several threads: ties are found across chunks (the
    last tensor is the same view as the second), a view at the same address but of another shape is no tie,
    and problems come back in index order with their rows left zero."""
    n = 8 * 2048 + 3  # more than one chunk on any machine that has a second thread
    base = torch.arange(2 * n, dtype=torch.int64)
    tensors = [base[2 * i:2 * i + 2] for i in range(n)]
    tensors[n - 1] = base[2:4]  # the same memory seen the same way as tensors[1]
    tensors[10000] = base[2:3]  # tensors[1]'s address, another shape
    tensors[9000] = torch.empty(3, device="meta")
    tensors[15000] = torch.zeros(4).to_sparse()
    table, canon, problems, held = _C.describe_tensors(tensors, torch.device("cpu"))
    assert len(held) == n
    assert [i for i, _ in problems] == [9000, 15000], problems
    assert "meta" in problems[0][1] and "dense" in problems[1][1]
    assert table[9000].eq(0).all() and table[15000].eq(0).all()
    want = list(range(n))
    want[n - 1] = 1
    assert canon.tolist() == want
    code = int(table[0, 0])
    assert table[:, 1].tolist() == [0 if i in (9000, 15000) else 1 for i in range(n)]
    assert table[10000, 2] == 1 and table[1, 2] == 2 and table[n - 1, 2] == 2 and table[n - 1, 0] == code


def test_a_load_plan_made_on_its_own_thread():
    """start_load_plan plans on a thread while the caller goes on: result() gives the plan load_plan would,
    raises what planning raised (a source that does not match its entry), and is taken once."""
    cpu = torch.device("cpu")
    sources = [torch.arange(4, dtype=torch.float32), torch.zeros(7, dtype=torch.int64)]
    table, _, _, held = _C.describe_tensors(sources, cpu)
    none = torch.zeros((0, 9), dtype=torch.int64)
    pending = _C.start_load_plan(table, held, [], none, 4096, 2, 0, 1, cpu)
    assert len(held) == 0  # taken before the thread starts
    plan = pending.result()
    assert plan.num_units_sent == 2 and plan.total_bytes == 4 * 4 + 7 * 8
    with pytest.raises(ValueError, match="taken once"):
        pending.result()
    bad = _C.start_load_plan(table[1:], [sources[0]], [], none, 4096, 2, 0, 1, cpu)
    with pytest.raises(ValueError, match="checkpoint tensor 0 on source rank 0 is Float of 4 elements"):
        bad.result()
    _C.start_load_plan(table, sources, [], none, 4096, 2, 0, 1, cpu)  # dropped unread: its thread is joined


def _load_dests(values, described, fed):
    """load_dests over plain CPU tensors (no DTensor), each value taking the checkpoint tensor of its index."""
    from coalesced_bcast import _dtensor
    DTensor, Replicate, Shard = _dtensor.classes()
    table, canon, problems, _ = described

    def never(*args):
        raise AssertionError("no DTensor here")
    return _C.load_dests(values, torch.arange(len(values)), table, canon, _C.IdSet(id(v) for v in values), DTensor,
                         Shard, Replicate, never, never, torch.device("cpu"), 0, False, feed=fed)


def _fed(described, n):
    table, _, _, held = described
    return _C.start_fed_load_plan(table, held, n, 4096, 2, 0, 2, torch.device("cpu"))


def test_a_fed_load_plan_is_the_plan_made_after_load_dests():
    """A plan fed its destinations by load_dests as it finds them (csrc/dest_feed.h) is the plan load_plan makes
    from load_dests's result: the same buckets, runs and direct buckets, the same bytes packed into every bucket
    (NaN payloads among them). It reads the source's tensors in place: they stay the caller's. Its result is
    taken only after close(). (The bytes that land: test_state_dict_gloo's check_many_keys, with and without.)"""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 3000, (2500,), generator=gen).tolist()  # more than the pack pass's own thread needs
    sources = []
    for i, n in enumerate(sizes):
        t = torch.empty(n, dtype=(torch.float32, torch.bfloat16, torch.int16)[i % 3])
        fill_random_bytes(t, gen)
        sources.append(t)
    sources[6].view(torch.int32)[:3] = torch.tensor([0x7FC00123, -2**31, 0x7F800001], dtype=torch.int32)
    dests = [torch.full_like(s, 7) for s in sources]
    dests[4] = torch.zeros(sizes[4], dtype=torch.float64)  # a cast, in the unpack
    described = _C.describe_tensors(sources, torch.device("cpu"))
    held = described[3]
    fed = _fed(described, len(dests))
    local, meta_t, units_t, rows, cast_keys, problems = _load_dests(dests, described, fed)
    assert problems == [] and cast_keys == 1 and torch.equal(rows, torch.arange(len(sources)))
    assert len(local) == 0  # fed, the feed alone holds the destinations
    local = _load_dests(dests, described, None)[0]
    with pytest.raises(ValueError, match="after close"):
        fed.result()
    fed.close(True)
    assert fed.used
    got = fed.result()
    assert len(held) == len(sources)  # not taken: the plan made as before could still have them
    want = _C.load_plan(units_t, held, local, meta_t, 4096, 2, 0, 2, torch.device("cpu"))
    facts = ("num_buckets", "slot_bytes", "num_scatter_runs", "num_host_runs", "num_units_sent", "total_bytes",
             "direct_buckets")
    assert [getattr(got, f) for f in facts] == [getattr(want, f) for f in facts] and got.num_buckets > 100
    a, b = (torch.empty(got.slot_bytes, dtype=torch.uint8) for _ in range(2))
    for k in range(got.num_buckets):  # the same bytes packed into every bucket
        a.fill_(0xA5), b.fill_(0xA5)  # (the stream pads between tensors: bytes no run writes)
        _C._copy_buckets(got, True, a, [k])
        _C._copy_buckets(want, True, b, [k])
        n = min(got.slot_bytes, got.total_bytes - k * got.slot_bytes)
        assert torch.equal(a[:n], b[:n]), k


def test_a_fed_load_plan_not_wanted_or_spoiled_gives_none():
    """A fed plan closed unwanted, or whose destination load_dests changed after putting it (a tensor named by
    two keys takes the last key's unit), is dropped: used is False and result() None, and the plan made as
    before serves. A problem of the plan's own (a destination that overlaps itself) is raised only where the
    plan is wanted. One never closed (load_dests raised) is dropped with its object, not waited for. The
    destinations put, which load_dests keeps no list of when fed, come back from it (dests()), once only."""
    sources = [torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) + 10]
    described = _C.describe_tensors(sources, torch.device("cpu"))
    shared = torch.zeros(6)
    fed = _fed(described, 2)
    out = _load_dests([shared, shared], described, fed)
    assert out[5] == [] and len(out[0]) == 0 and out[1][0, 0] == 1  # one destination, of the last key's unit
    with pytest.raises(ValueError, match="after its result"):
        fed.dests()
    fed.close(True)
    assert not fed.used and fed.result() is None
    dests = fed.dests()
    assert len(dests) == 1
    with pytest.raises(ValueError, match="taken once"):
        fed.dests()
    # the plan made from them is the one made from load_dests's own list, without a feed
    plans = [_C.load_plan(out[2], _C.describe_tensors(sources, torch.device("cpu"))[3], d, out[1], 4096, 2, 0, 1,
                          torch.device("cpu"))
             for d in (dests, _load_dests([shared, shared], described, None)[0])]
    facts = ("num_buckets", "num_scatter_runs", "num_units_sent", "total_bytes")
    assert [getattr(plans[0], f) for f in facts] == [getattr(plans[1], f) for f in facts]
    assert plans[0].num_scatter_runs == 1
    fed = _fed(described, 2)
    _load_dests([torch.zeros(6), torch.zeros(6)], described, fed)
    fed.close(False)
    assert not fed.used and fed.result() is None
    assert len(fed.dests()) == 2
    overlapping = [torch.zeros(1).expand(6), torch.zeros(6)]
    for use in (True, False):
        fed = _fed(described, 2)
        _load_dests(overlapping, described, fed)
        fed.close(use)
        if use:
            with pytest.raises(ValueError, match="destination 0 on rank 0 overlaps itself"):
                fed.result()
        else:
            assert fed.result() is None
    _fed(described, 2)  # dropped open: its thread stops


def test_the_load_metadata_crosses_as_raw_bytes():
    from coalesced_bcast.state_dict import _from_wire, _to_wire
    table = torch.randint(-2**40, 2**40, (5, 10), dtype=torch.int64)
    meta = dict(keys=["a"], rows=torch.arange(5), table=table, canon=torch.zeros(0, dtype=torch.int64), fatal=None)
    wire = _to_wire(meta)
    assert all(isinstance(wire[k], tuple) for k in ("rows", "table", "canon")) and meta["table"] is table
    back = _from_wire(wire)
    assert torch.equal(back["table"], table) and torch.equal(back["rows"], torch.arange(5))
    assert back["canon"].shape == (0,) and back["canon"].dtype == torch.int64 and back["keys"] == ["a"]
    assert _from_wire(_to_wire(dict(fatal="x", rows=None)))["rows"] is None

"""Planner unit tests: no communication, one process."""
import pytest
import torch

from coalesced_bcast import _C

KIB = 1024


def plan(tensors, bucket=4 * KIB, depth=3, inplace=1 << 40, coalesce=1 << 30, names=()):
    return _C.Plan(list(tensors), list(names), bucket, depth, inplace, coalesce, 0)


def runs(p):
    """Every (unique, tensor_offset, bucket_offset, nbytes, strided) run, with its bucket index."""
    return [(k, *op) for k, (_, ops) in enumerate(p.bucket_table()) for op in ops]


def test_bucket_boundaries_and_splitting():
    a = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    b = torch.zeros(3000, dtype=torch.float32)  # 12000 bytes: spans buckets
    c = torch.zeros(10, dtype=torch.int8)
    p = plan([a, b, c])
    table = p.bucket_table()
    assert all(nbytes <= 4 * KIB for nbytes, _ in table)
    # a at 0; b starts at 4000 (already 16-aligned) and is cut at each 4 KiB boundary
    assert runs(p)[0] == (0, 0, 0, 0, 4000, False)
    b_runs = [r for r in runs(p) if r[1] == 1]
    assert [r[2] for r in b_runs] == [0, 96, 96 + 4096, 96 + 8192]
    assert sum(r[4] for r in b_runs) == 12000
    assert all(r[3] == 0 for r in b_runs[1:])  # later pieces start their bucket
    assert p.num_buckets == len(table) == 4
    assert p.packed_bytes == 4000 + 12000 + 10


def test_alignment_of_every_tensor_start():
    ts = [torch.zeros(n, dtype=torch.uint8) for n in (1, 3, 17, 33, 5)]
    p = plan(ts)
    starts = [r[3] for r in runs(p) if r[2] == 0]
    assert starts == [0, 16, 32, 64, 112]  # 1, 3, 17, 33 bytes, each rounded up to 16
    assert all(s % 16 == 0 for s in starts)


def test_no_run_crosses_a_bucket_and_runs_are_sorted():
    g = torch.Generator().manual_seed(0)
    ts = [torch.zeros(int(torch.randint(1, 3000, (1,), generator=g)), dtype=torch.float16) for _ in range(200)]
    p = plan(ts, bucket=8 * KIB)
    for nbytes, ops in p.bucket_table():
        ends = [o[2] + o[3] for o in ops]
        assert max(ends) == nbytes <= 8 * KIB
        assert all(ops[i][2] + ops[i][3] <= ops[i + 1][2] for i in range(len(ops) - 1))
    per_tensor = {}
    for r in runs(p):
        per_tensor[r[1]] = per_tensor.get(r[1], 0) + r[4]
    assert per_tensor == {u: t.numel() * 2 for u, t in enumerate(ts)}


def test_tied_and_aliased_tensors_are_sent_once():
    w = torch.zeros(64, 8)
    other = torch.zeros(5)
    # w, w again and its reshaped alias (the same byte range) map to one unique tensor
    p = plan([w, other, w, w.view(-1)])
    assert p.input_to_unique == [0, 1, 0, 0]
    assert p.num_unique == 2
    assert p.total_bytes == w.numel() * 4 + 5 * 4


def test_overlapping_views_are_refused_with_names():
    base = torch.zeros(100)
    with pytest.raises(ValueError, match=r"tensor 0 \('a'\) on rank 0.*tensor 1 \('b'\).*overlapping"):
        plan([base[:60], base[40:]], names=["a", "b"])
    with pytest.raises(ValueError, match="overlapping"):
        plan([base.view(10, 10), base.view(10, 10).t()])


def test_interleaved_strided_views_are_allowed():
    base = torch.zeros(8, 10)
    p = plan([base[:, 0::2], base[:, 1::2]])
    assert p.num_unique == 2
    assert all(r[5] for r in runs(p))  # both strided


def test_inplace_threshold_and_coalesced_groups():
    big = [torch.zeros(1024) for _ in range(5)]  # 4 KiB each
    small = torch.zeros(10)
    p = plan(big + [small], inplace=4 * KIB, coalesce=8 * KIB)
    assert p.num_inplace == 5
    assert p.inplace_groups == [[0, 1], [2, 3], [4]]
    assert p.packed_bytes == 40
    # strided tensors with gaps are never in place, whatever their size
    p = plan([torch.zeros(64, 128)[:, ::2]], inplace=1)
    assert p.num_inplace == 0 and p.num_buckets == 4  # 16 KiB through 4 KiB buckets
    # nor are tensors that are not whole, aligned 16-byte words (NCCL reads past their end)
    base = torch.zeros(10000, dtype=torch.uint8)
    p = plan([base[:8001], base[8016:8016 + 1024], base[9041:9041 + 512]], inplace=1)
    assert p.num_inplace == 1 and p.inplace_groups == [[1]]


def test_a_few_small_tensors_go_in_place_with_the_large_ones():
    big = [torch.zeros(2048) for _ in range(2)]  # 8 KiB each
    small = [torch.zeros(4) for _ in range(3)]  # 16 bytes each
    few = _C.Plan(big + small, [], 4 * KIB, 3, 4 * KIB, 1 << 30, 0, 3)
    assert few.num_inplace == 5 and few.num_buckets == 0 and few.inplace_groups == [[0, 1, 2, 3, 4]]
    many = _C.Plan(big + small, [], 4 * KIB, 3, 4 * KIB, 1 << 30, 0, 2)  # 3 small > 2: the ring
    assert many.num_inplace == 2 and many.num_buckets == 1 and many.packed_bytes == 3 * 16
    # counted by size alone (the same on every rank with the same structure); those that cannot go
    # in place (here: 12 bytes, not whole 16-byte words) still count, and go through the ring
    odd = _C.Plan(big + small[:2] + [torch.zeros(3)], [], 4 * KIB, 3, 4 * KIB, 1 << 30, 0, 3)
    assert odd.num_inplace == 4 and odd.routes().tolist() == [1, 1, 1, 1, 0]


def test_routes_are_restricted_to_what_every_rank_allows():
    ts = [torch.zeros(1024) for _ in range(4)]  # 4 KiB each
    p = plan(ts, inplace=4 * KIB)
    assert p.routes().tolist() == [1, 1, 1, 1] and p.num_buckets == 0
    # another rank has tensor 2 transposed or unaligned: it goes through the ring here too
    p.restrict_routes(torch.tensor([1, 1, 0, 1], dtype=torch.uint8))
    assert p.routes().tolist() == [1, 1, 0, 1] and p.num_inplace == 3 and p.packed_bytes == 4 * KIB
    assert p.num_buckets == 1 and [r[1] for r in runs(p)] == [2]
    # routes only ever narrow: allowing more than this rank can do changes nothing
    p.restrict_routes(torch.ones(4, dtype=torch.uint8))
    assert p.routes().tolist() == [1, 1, 0, 1]
    # a tensor this rank already sends through buckets does not shift the mask onto its neighbours
    q = plan([torch.zeros(32, 32).t(), torch.zeros(1024), torch.zeros(1024)], inplace=4 * KIB)
    assert q.routes().tolist() == [0, 1, 1]
    q.restrict_routes(torch.tensor([1, 1, 0], dtype=torch.uint8))
    assert q.routes().tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="one per unique tensor"):
        p.restrict_routes(torch.ones(3, dtype=torch.uint8))


def test_dense_tensors_travel_in_memory_order():
    """A transpose or a channels_last weight fills its extent without gaps: its bytes go as they lie
    (in place, or copied whole into buckets) while every rank lays it out the same way; the routes'
    hash covers the layout, and a restriction (ranks' routes differ) sends it element by element."""
    t = torch.zeros(64, 64).t()
    conv = torch.zeros(8, 16, 3, 3).to(memory_format=torch.channels_last)
    p = plan([t, conv], inplace=1)
    assert p.num_inplace == 2 and p.num_buckets == 0
    assert p.routes().tolist() == [0, 0]  # without memory order neither could go in place
    q = plan([t, conv])  # through buckets: memory order, copied whole
    assert q.packed_bytes == 16 * KIB + 4608 and not any(r[5] for r in runs(q))
    q.restrict_routes(torch.ones(2, dtype=torch.uint8))  # some rank's routes differ: logical order
    assert q.packed_bytes == 16 * KIB + 4608 and all(r[5] for r in runs(q))
    p.restrict_routes(torch.ones(2, dtype=torch.uint8))
    assert p.num_inplace == 0 and p.num_buckets == 6 and all(r[5] for r in runs(p))

    def hashes(*ts):
        _, fp_hash, routes_hash = plan(ts).digest()
        return fp_hash, routes_hash

    same = hashes(torch.ones(64, 64).t(), conv)
    assert hashes(torch.zeros(64, 64).t(), torch.ones_like(conv)) == same  # values do not count
    contiguous = hashes(torch.zeros(64, 64), conv.contiguous())  # the same structure, other layouts
    assert contiguous[0] == same[0] and contiguous[1] != same[1]
    assert hashes(torch.zeros(64, 64).t(), conv.contiguous())[1] not in (same[1], contiguous[1])
    # size-1 dims place nothing: their strides do not count
    a, b = torch.zeros(1, 32, 16).transpose(1, 2), torch.zeros(32, 1, 16).permute(1, 2, 0)
    assert a.shape == b.shape and a.stride() != b.stride() and hashes(a) == hashes(b)


def test_back_to_back_tensors_of_one_buffer_go_as_one_broadcast():
    buf = torch.zeros(4096)
    views = [buf[0:1024].view(32, 32), buf[1024:2048], buf[2048:3072], buf[3072:4096]]  # 4 KiB each
    p = plan(views, inplace=4 * KIB)
    assert p.routes().tolist() == [3, 3, 3, 1]  # in place (bit 0), joined to the next (bit 1)
    assert p.num_inplace == 4 and p.inplace_ops == 1 and p.inplace_groups == [[0, 1, 2, 3]]
    # another rank has them in separate allocations from tensor 2 on: the run stops there everywhere
    p.restrict_routes(torch.tensor([3, 1, 1, 1], dtype=torch.uint8))
    assert p.routes().tolist() == [3, 1, 1, 1] and p.inplace_ops == 3
    # a gap, another storage, or a tensor that goes through buckets ends a run
    other = torch.zeros(1024)
    q = plan([buf[0:1024], buf[1040:2064], other, buf[2064:3088]], inplace=4 * KIB)
    assert q.routes().tolist() == [1, 1, 1, 1] and q.inplace_ops == 4
    r = plan([buf[0:1024], buf[1024:1028], buf[1028:2052]], inplace=4 * KIB)  # 16 bytes in the middle: packed
    assert r.routes().tolist() == [1, 0, 1] and r.inplace_ops == 2 and r.num_buckets == 1
    # a run is never split by the group size: groups close after a run ends
    s = plan(views + [torch.zeros(1024)], inplace=4 * KIB, coalesce=4 * KIB)
    assert s.inplace_groups == [[0, 1, 2, 3], [4]] and s.inplace_ops == 2


def test_ring_is_bounded_by_depth_and_shrinks_to_the_data():
    ts = [torch.zeros(1000) for _ in range(40)]  # 160 KB: 40 buckets of 4 KiB
    p = plan(ts, depth=3)
    assert (p.ring_slots, p.slot_bytes) == (3, 4 * KIB)
    p = plan(ts[:1], depth=3)
    assert (p.ring_slots, p.slot_bytes) == (1, 4000)


def test_empty_and_zero_element_tensors():
    p = plan([])
    assert (p.num_unique, p.num_buckets) == (0, 0)
    p = plan([torch.zeros(0, 3), torch.zeros(())])
    assert p.num_unique == 2 and p.total_bytes == 4 and p.num_buckets == 1


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.zeros(3, device="meta"), "meta device"),
    (lambda: torch.zeros(3, 3).to_sparse(), "sparse"),
    (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "nested"),
    (lambda: torch.zeros(1).expand(4), "overlaps itself"),
    # its values are not its bytes: a byte view of it is refused, and its memory is right to send only where
    # every rank has the same bit (before: 0-dim ones went through the CPU pack conjugated, others failed mid-send)
    (lambda: torch.zeros(3, dtype=torch.complex64).conj(), "lazy conjugate or negative bit"),
    (lambda: torch.zeros((), dtype=torch.complex128).conj(), "lazy conjugate or negative bit"),
    (lambda: torch.zeros(3)._neg_view(), "lazy conjugate or negative bit"),
])
def test_bad_input_names_tensor_and_rank(bad, match):
    with pytest.raises(ValueError, match=rf"tensor 1 \('x.bad'\) on rank 0.*{match}|{match}"):
        plan([torch.zeros(2), bad()], names=["ok", "x.bad"])


def test_options_are_checked():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan([torch.zeros(2)], bucket=1000)
    with pytest.raises(ValueError, match="ring_depth"):
        plan([torch.zeros(2)], depth=0)


def test_digest_follows_the_fingerprint_and_routes():
    buf = torch.zeros(4096)
    p = plan([buf[:2048], buf[2048:], torch.zeros(3)], inplace=4 * KIB)
    assert p.digest()[0] == p.fingerprint().numel()
    q = plan([buf[:2048], torch.zeros(2048), torch.zeros(3)], inplace=4 * KIB)  # same structure, not joined
    assert q.digest()[:2] == p.digest()[:2] and q.digest()[2] != p.digest()[2]
    # any change of structure changes the structure hash: a shape, a dtype, a tie, one more tensor
    w = torch.zeros(3)
    base = plan([torch.zeros(4, 3), w, w]).digest()
    for other in ([torch.zeros(3, 4), w, w], [torch.zeros(4, 3, dtype=torch.float64), w, w],
                  [torch.zeros(4, 3), w, w.clone()], [torch.zeros(4, 3), w, w, w]):
        assert plan(other).digest()[1] != base[1]
    v = torch.randn(3)  # other values, other memory, the same structure and tie
    assert plan([torch.randn(4, 3), v, v]).digest()[:2] == base[:2]


def test_fingerprint_captures_structure_not_values():
    a = [torch.zeros(4, 3), torch.ones(2, dtype=torch.int64)]
    b = [torch.randn(4, 3), torch.full((2,), 7, dtype=torch.int64)]
    assert torch.equal(plan(a).fingerprint(), plan(b).fingerprint())
    c = [torch.zeros(3, 4), torch.ones(2, dtype=torch.int64)]
    assert not torch.equal(plan(a).fingerprint(), plan(c).fingerprint())
    w = torch.zeros(3)
    assert not torch.equal(plan([w, w]).fingerprint(), plan([w, w.clone()]).fingerprint())


def test_check_of_the_inputs_that_the_first_buckets_read():
    """A speculating source checks only what its first buckets copy before it packs them."""
    ts = [torch.zeros(128, dtype=torch.float32) for _ in range(30)]  # 512 bytes each: 8 per 4 KiB bucket
    ts.insert(5, ts[2])  # an alias, sent once
    p = plan(ts)
    assert p.num_buckets == 4
    assert p.inputs_of_buckets(0) == 0
    assert p.inputs_of_buckets(1) == 9  # uniques 0..7: inputs 0..8, the alias among them
    assert p.inputs_of_buckets(2) == 17 and p.inputs_of_buckets(99) == 31
    ts[12].data = torch.zeros(128)  # in the second bucket: re-allocated
    assert p.check_unchanged(9) == ""
    assert p.check_unchanged(17).startswith("tensor 12") and "re-allocated" in p.check_unchanged(17)
    assert p.check_unchanged().startswith("tensor 12")
    ts[3].resize_(7)
    assert p.check_unchanged(9).startswith("tensor 3") and "changed shape" in p.check_unchanged(9)
    # the rest of the check, after those: the first inputs passed over, a later change still found
    assert p.check_unchanged(start=9).startswith("tensor 12") and p.check_unchanged(9, start=9) == ""
    assert p.check_unchanged(start=13) == "" and p.check_unchanged(start=99) == ""
    assert p.check_unchanged(start=0).startswith("tensor 3") and p.check_unchanged(start=-5).startswith("tensor 3")
    # a tensor split across two buckets: the first bucket's check covers it
    q = plan([torch.zeros(1000), torch.zeros(10)])  # 4000 + 40 bytes: the second starts bucket 0, ends there
    assert q.inputs_of_buckets(1) == 2
    r = plan([torch.zeros(2000), torch.zeros(10)])  # the first spans buckets 0 and 1
    assert r.inputs_of_buckets(1) == 1 and r.inputs_of_buckets(2) == 2


def test_check_unchanged_over_many_tensors_names_the_first_change():
    """A kept plan's check runs in chunks on several threads: it still reports the first changed tensor."""
    ts = [torch.zeros(8 + i % 5) for i in range(10000)]
    p = plan(ts)
    assert p.check_unchanged() == ""
    ts[9000].set_(torch.zeros(9000 % 5 + 8))  # re-allocated, same shape (a later chunk)
    assert p.check_unchanged().startswith("tensor 9000") and "re-allocated" in p.check_unchanged()
    ts[3001].resize_(100)  # reshaped and re-allocated (an earlier chunk): now the first
    assert p.check_unchanged().startswith("tensor 3001"), p.check_unchanged()
    assert p.check_unchanged(start=3002).startswith("tensor 9000")  # in chunks from there


def test_planning_over_many_tensors_names_the_first_bad_one():
    """Planning reads the tensors in chunks on several threads: the error is still the first bad input's."""
    ts = [torch.zeros(8 + i % 5) for i in range(20000)]
    ts[15000] = torch.zeros(3, device="meta")  # a later chunk
    ts[7000] = torch.zeros(1).expand(4)  # an earlier chunk: the first bad input
    names = [f"t{i}" for i in range(len(ts))]
    with pytest.raises(ValueError, match=r"tensor 7000 \('t7000'\) on rank 0 .*overlaps itself"):
        plan(ts, names=names)
    ts[7000] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"tensor 15000 \('t15000'\) on rank 0 is on the meta device"):
        plan(ts, names=names)
    ts[15000] = ts[5]  # a tie across chunks: sent once
    p = plan(ts, names=names)
    assert (p.num_inputs, p.num_unique) == (20000, 19999)


def test_a_plan_keeps_its_tensors_alive_through_a_snapshot_of_the_list():
    """A plan made from a Python list borrows its tensors (no C++ reference of its own each, which torch >= 2.10
    pays for with a Python incref) and keeps a tuple of the list's items instead: the caller may empty its list,
    the plan still reads the tensors, and once the plan is gone so are they, with nothing left over."""
    import gc
    import sys
    import weakref
    ts = [torch.zeros(4 + i % 3) for i in range(3000)]
    refs = [weakref.ref(t) for t in ts]
    one = ts[1]
    before = sys.getrefcount(one)
    p = _C.Plan(ts, [], 4 * KIB, 2, 1 << 40, 1 << 30, 0)
    after = sys.getrefcount(one)
    assert after == before + 1  # the snapshot's reference
    del one
    ts[2].resize_(50)  # changed in place: the plan sees the very tensor
    ts.clear()
    gc.collect()
    assert all(r() is not None for r in refs)
    assert p.check_unchanged().startswith("tensor 2 ")
    assert p.num_inputs == 3000 and len(p.bucket_table()) == p.num_buckets
    copy_ok = p.fingerprint()  # reads every input
    assert copy_ok.numel() > 3000
    del p, copy_ok
    gc.collect()
    assert [i for i, r in enumerate(refs) if r() is not None] == []


@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="no copy-on-write tensors in this torch")
def test_copy_on_write_inputs_are_materialized_once():
    """A lazy clone shares its source's storage until written: planning materializes it (the sync writes
    it), and the source and its clone are two tensors, even among thousands planned on several threads."""
    ts = [torch.arange(8.0) + i for i in range(20000)]
    ts[14500] = torch._lazy_clone(ts[10])  # in another chunk than its source
    ts.append(ts[14500].view(2, 4))  # an alias of the clone
    if hasattr(torch._C, "_is_cow_tensor"):
        assert torch._C._is_cow_tensor(ts[14500])
    p = plan(ts)
    assert ts[14500].data_ptr() != ts[10].data_ptr() and torch.equal(ts[14500], ts[10])
    assert (p.num_inputs, p.num_unique) == (20001, 20000)
    assert p.check_unchanged() == ""


@pytest.mark.parametrize("order", ["ascending", "a few descents", "shuffled"])
def test_aliases_found_whatever_the_order_of_addresses(order):
    """Aliases are found by sorting the tensors' byte ranges: ascending runs are merged, other orders sorted."""
    import random
    buf = torch.zeros(3000 * 8)
    views = [buf[i * 8:(i + 1) * 8] for i in range(3000)]
    rng = random.Random(0)
    if order == "a few descents":
        blocks = [views[b * 500:(b + 1) * 500] for b in (3, 0, 5, 1, 4, 2)]  # ascending within each
        views = [v for b in blocks for v in b]
    elif order == "shuffled":
        rng.shuffle(views)
    ts = views + [views[7].view(2, 4), views[2999], views[0].clone()]
    p = plan(ts)
    assert (p.num_inputs, p.num_unique) == (3003, 3001)
    assert p.input_to_unique[3000] == p.input_to_unique[7] and p.input_to_unique[3001] == p.input_to_unique[2999]


_FORKED_CHILD = """
import os, sys, torch
from coalesced_bcast import _C
ts = [torch.zeros(8) for _ in range(20000)]
_C.Plan(ts, [], 1 << 20, 2, 1 << 30, 1 << 30, 0)  # the parent's planning starts torch's inter-op pool
pid = os.fork()
if pid == 0:
    p = _C.Plan(ts, [], 1 << 20, 2, 1 << 30, 1 << 30, 0)
    os._exit(0 if p.num_unique == 20000 and p.check_unchanged() == "" else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_plans_without_the_parents_thread_pool():
    """torch's inter-op pool has no threads in a forked child: planning and the check run on the calling
    thread there (handed to the pool, they waited forever)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _FORKED_CHILD], env=env, timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]

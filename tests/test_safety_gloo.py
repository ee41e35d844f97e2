"""Never hang, never corrupt, over gloo: structural mismatches raise the same AgreementError on every
rank before any byte moves; a rank that dies or never arrives makes the others fail within the
timeout; bad input is refused on every rank; autograd leaves stay leaves."""
import gc
import json
import os
import re
import struct
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from coalesced_bcast import AgreementError, _C, agree
from coalesced_bcast import _store_agreement as store_agreement
from coalesced_bcast.agree import check_agreement
from dist_utils import run_ranks
from zoo import same_bits

SLACK_S = 8.0  # process scheduling on a loaded 2-core CI machine, not the library

# _COLLECT_NOTE: pytest.raises keeps exceptions whose frames hold the process group; a group object that
# outlives destroy_process_group and dies at interpreter exit can abort the process (seen with gloo:
# "terminate called without an active exception"), so each body breaks those cycles before returning.


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta
            and t.layout == torch.strided and not t.is_nested]


def _expect_refusal(rank, world_size, tensors, src, group=None, names=None, match="", **kw) -> str:
    """The call raises the same error on every rank within seconds and writes nothing anywhere."""
    before = _snapshot(tensors)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        coalesced_bcast.broadcast_tensors(tensors, src, group, names=names, **kw)
    elapsed = time.monotonic() - t0
    after = _snapshot(tensors)
    assert all(same_bits(a, b) for a, b in zip(before, after)), f"rank {rank}: a tensor was written"
    assert elapsed < 5, f"rank {rank}: took {elapsed:.1f} s"
    msg = str(err.value)
    gathered = [None] * (group.size() if group is not None else world_size)
    dist.all_gather_object(gathered, msg, group=group)
    assert all(m == msg for m in gathered), gathered
    assert isinstance(err.value, AgreementError), msg
    if match:
        assert re.search(match, msg), (match, msg)
    return msg


def _filled(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _store_costs(rank, world_size, base, names, pg, odd, val):
    # When all is well, through the store: a few small round trips per rank, no collective on the group.
    tensors = base()
    ops = []
    real_store = store_agreement._group_store

    class Counting:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            fn = getattr(self.store, name)

            def counted(*args):
                ops.append((name, sum(len(a) for a in args if isinstance(a, (str, bytes)))))
                return fn(*args)
            return counted

    store_agreement._group_store = lambda g: Counting(real_store(g))
    try:
        check_agreement(_C.Plan(tensors, names, 4096, 2, 1 << 40, 0, rank), None, pg, 0, names)  # the group's first
        queues = store_agreement._groups[pg].queues
        for i in range(4):
            plan = _C.Plan(tensors, names, 4096, 2, 1 << 40, 0, rank)
            seq0 = pg._get_sequence_number_for_group()
            ops.clear()
            assert check_agreement(plan, None, pg, 0, names) is None
            assert pg._get_sequence_number_for_group() == seq0
            seq = store_agreement._groups[pg].seq - 1
            # Every rank: one compare_set (publish or read the record). Two ranks: the second to arrive
            # sends the verdict (no reply awaited), the first waits for it and pops it from a queue that
            # it leaves empty for the agreement after next, or, on a store without queues (FileStore),
            # gets it and removes the verdict key of the agreement before last. More ranks:
            # an add each, then the last sets the verdict and the others wait for it; two keys removed.
            names_ = [name for name, _ in ops]
            every = [None] * world_size
            dist.all_gather_object(every, names_)
            if world_size == 2 and queues:
                assert sorted(every) == [["compare_set", "queue_push"], ["compare_set", "wait", "queue_pop"]], every
            elif world_size == 2:
                assert sorted(every, key=len)[0] == ["compare_set", "set"], every
                assert sorted(every, key=len)[1] == ["compare_set"] + ["delete_key"] * (seq >= 2) + \
                    ["wait", "get"], every
            else:
                assert sum("set" in e for e in every) == 1, every  # the last to add (not always the last to arrive)
                assert len(ops) <= 2 + 2 + (2 if seq >= 2 else 0), ops
            assert all(size < 200 for _, size in ops), ops
        seq0 = pg._get_sequence_number_for_group()
        stats = coalesced_bcast.broadcast_tensors(tensors, 0, names=names, bucket_bytes=4096)
        assert pg._get_sequence_number_for_group() - seq0 == stats.buckets + stats.inplace_ops
    finally:
        store_agreement._group_store = real_store
    assert same_bits(tensors[1], _filled((4, 6), torch.float32, 10))



def _collective_costs(rank, world_size, base, names, pg, odd, val):
    # Groups larger than STORE_MAX_RANKS: exactly one small collective before the payload.
    os.environ[agree._STORE_ENV] = "0"
    tensors = base()
    calls = []
    real = agree.all_gather

    def counting(out, inp, *args, **kwargs):
        calls.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    agree.all_gather = counting
    try:
        plan = _C.Plan(tensors, names, 4096, 2, 1 << 40, 0, rank)
        seq0 = pg._get_sequence_number_for_group()
        check_agreement(plan, None, pg, 0, names)
        assert pg._get_sequence_number_for_group() - seq0 == 1
        assert calls == [512], calls
        seq0 = pg._get_sequence_number_for_group()
        stats = coalesced_bcast.broadcast_tensors(tensors, 0, names=names, bucket_bytes=4096)
        assert pg._get_sequence_number_for_group() - seq0 == 1 + stats.buckets + stats.inplace_ops
    finally:
        agree.all_gather = real
        del os.environ[agree._STORE_ENV]
    assert same_bits(tensors[1], _filled((4, 6), torch.float32, 10))



def _mismatches(rank, world_size, base, names, pg, odd, val):
    cases = []
    t = base()
    if rank == odd:
        t[1] = t[1].reshape(6, 4)  # the same bytes, transposed shape
    cases.append((t, 0, r"tensor 1 \('w'\): the source has shape \[4, 6\] Float \(96 bytes\), "
                        rf"rank {odd} has shape \[6, 4\] Float \(96 bytes\)"))
    t = base()
    if rank == odd:
        t[0] = t[0].to(torch.int32)
    cases.append((t, 0, rf"tensor 0 \('a'\): the source has shape \[5\] Float \(20 bytes\), rank {odd} has "
                        r"shape \[5\] Int \(20 bytes\)"))
    t = base() + ([_filled((3,), torch.float32, val)] if rank == odd else [])
    cases.append((t, 0, rf"the source has 3 tensors, rank {odd} has 4: tensor 3 \('extra'\) is extra"))
    t = base()[:2] if rank == odd else base()
    cases.append((t, 0, rf"the source has 3 tensors, rank {odd} has 2: tensor 2 is missing"))
    # A tie on the source that is not a tie elsewhere: same shapes and dtypes everywhere.
    t = base()
    t[2] = t[0] if rank == 0 else _filled((5,), torch.float32, val)
    cases.append((t, 0, r"tensor 2 \('b'\): the source sends it as the same memory as tensor 0 \('a'\), "
                        r"rank \d as the same memory as tensor 2 \('b'\) \(tied on one side only\)"))
    # ... and a tie on one receiver only, with a source other than rank 0.
    src = 1 if world_size > 2 else 0
    t = base()
    t[2] = t[0] if rank == odd else _filled((5,), torch.float32, val)
    cases.append((t, src, rf"rank {odd} does not match source rank {src}.*tensor 2 \('b'\): the source sends it as "
                          rf"the same memory as tensor 2 \('b'\), rank {odd} as the same memory as tensor 0 \('a'\)"))
    for store_max in ("64", "0"):  # both ways of agreeing: through the store, through a collective
        os.environ[agree._STORE_ENV] = store_max
        for tensors, src, match in cases:
            src_before = [x.clone() for x in tensors]
            _expect_refusal(rank, world_size, tensors, src, names=names[:len(tensors)] + ["extra"][:len(tensors) - 3],
                            match=match)
            if rank == src:
                assert all(same_bits(a, b) for a, b in zip(src_before, tensors))

        # Ranks that name different sources (each a valid rank) are caught too.
        _expect_refusal(rank, world_size, base(), src=rank, names=names, match="the ranks name different sources")
        # A source that is not in the group, on one rank only: every rank raises at once.
        _expect_refusal(rank, world_size, base(), src=7 if rank == odd else 0, names=names,
                        match=rf"rank {odd} refused its input.*src=7 is not a rank of the group")
        # Refusals on two ranks: every rank names the same one, the lowest.
        if world_size > 2:
            x = base()
            if rank:
                x[0] = torch.empty(5, device="meta")
            _expect_refusal(rank, world_size, x, 0, names=names, match=r"rank 1 refused its input.*on rank 1 is on "
                                                                        r"the meta device")
    del os.environ[agree._STORE_ENV]


def _usable_after(rank, world_size, base, names, pg, odd, val):
    # The group is still usable after all of that.
    want = [_filled((5,), torch.float32, 10), _filled((4, 6), torch.float32, 10), _filled((8,), torch.int64, 10)]
    tensors = base()
    coalesced_bcast.broadcast_tensors(tensors, 0, names=names, verify=True)
    assert all(same_bits(a, b) for a, b in zip(tensors, want))
    # A group that finds an earlier group's keys in its store (destroy_process_group, then
    # init_process_group on the same store): what this rank kept about the group is gone, the
    # store's slots hold the earlier group's records. The new incarnation agrees under keys of its own.
    assert store_agreement._groups[pg].prefix == "coalesced_bcast/agree/0/"
    del store_agreement._groups[pg]
    tensors = base()
    coalesced_bcast.broadcast_tensors(tensors, 0, names=names)
    coalesced_bcast.broadcast_tensors(tensors, 0, names=names, verify=True)
    assert all(same_bits(a, b) for a, b in zip(tensors, want))
    assert store_agreement._groups[pg].prefix == "coalesced_bcast/agree/1/"




def _agreement_body_checks(rank, world_size):
    odd = world_size - 1  # the rank whose structure differs
    val = 10 + rank  # receivers' values differ from the source's: a write would show

    def base():
        return [_filled((5,), torch.float32, val), _filled((4, 6), torch.float32, val), _filled((8,), torch.int64, val)]

    names = ["a", "w", "b"]
    pg = dist.group.WORLD

    for check in (_store_costs, _collective_costs, _mismatches, _usable_after):
        check(rank, world_size, base, names, pg, odd, val)
def _agreement_body(rank, world_size, queues):
    try:
        _agreement_body_checks(rank, world_size)
        assert store_agreement._groups[dist.group.WORLD].queues == queues
    finally:
        gc.collect()  # see _COLLECT_NOTE


@pytest.mark.parametrize("world_size,store", [(2, "file"), (2, "tcp"), (3, "file")])
def test_agreement_mismatch_raises_everywhere_before_any_byte(world_size, store):
    """store: FileStore (no queues: the verdict goes through keys) or TCPStore (through a queue, where this
    torch's stores have queues: torch >= 2.8; before, through keys as with a FileStore)."""
    queues = store == "tcp" and world_size == 2 and hasattr(dist.Store, "queue_push")
    run_ranks(world_size, _agreement_body, queues, store=store)


def _routes_body(rank, world_size):
    try:
        odd = world_size - 1  # the rank whose copies are laid out differently
        want = [_filled((64, 64), torch.float32, 1), _filled((1024,), torch.float32, 2), _filled((4,), torch.float32, 3)]
        for store_max in ("64", "0"):  # through the store, through a collective
            os.environ[agree._STORE_ENV] = store_max
            for layout in ("transposed", "unaligned", "same", "one buffer", "one buffer but one rank",
                           "transposed everywhere"):
                mine = [x.clone() if rank == 0 else torch.full_like(x, -1.0) for x in want]
                if (rank == odd and layout == "transposed") or layout == "transposed everywhere":
                    mine[0] = mine[0].t().contiguous().t()  # same shape, not contiguous: another memory order
                if rank == odd and layout == "unaligned":  # contiguous, but 4 bytes off a 16-byte boundary
                    mine[1] = torch.full((1025,), -1.0)[1:]
                if layout == "one buffer" or (layout == "one buffer but one rank" and rank != odd):
                    buf = torch.cat([mine[0].reshape(-1), mine[1]])  # w and v back to back: one broadcast
                    mine[:2] = [buf[:4096].view(64, 64), buf[4096:]]
                stats = coalesced_bcast.broadcast_tensors(mine, 0, names=["w", "v", "s"], inplace_min_bytes=4096,
                                                          small_inplace_max=0)
                assert all(same_bits(a, b) for a, b in zip(mine, want)), (rank, layout, store_max)
                # the odd rank could send its transposed copy in place in its own memory order, alone
                expect = 1 if layout == "transposed" or (layout == "unaligned" and rank != odd) else 0
                assert stats.rerouted == expect, (rank, layout, stats)
                # every rank sends the same tensors in place, whoever could not, in as many broadcasts
                assert stats.inplace_tensors == (1 if layout in ("transposed", "unaligned") else 2), (rank, layout)
                assert stats.inplace_ops == (1 if layout == "one buffer" else stats.inplace_tensors), (rank, layout)
        del os.environ[agree._STORE_ENV]
    finally:
        gc.collect()  # see _COLLECT_NOTE


@pytest.mark.parametrize("world_size,store", [(2, "file"), (2, "tcp"), (3, "file")])
def test_layouts_that_differ_between_ranks_are_routed_alike(world_size, store):
    """A tensor contiguous and aligned on one rank but not another (a transposed or offset copy of the
    same shape) must go through buckets on every rank: before the fix the ranks' broadcasts did not
    pair up and the receivers ended with wrong bytes."""
    run_ranks(world_size, _routes_body, store=store)


class Tiny(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.lin = nn.Linear(6, 4, device=device)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))


def _bad_tensors(rank, world_size):
    torch.manual_seed(rank)
    t = lambda: [torch.randn(10), torch.randn(3, 4)]  # noqa: E731

    # Meta, sparse and nested tensors: refused where they are, raised everywhere.
    m = Tiny(device="meta" if rank == 1 else None)
    before = _snapshot(list(m.parameters()))
    with pytest.raises(AgreementError, match=r"rank 1 refused its input.*tensor 0 \('lin.weight'\) on rank 1 is on "
                                             r"the meta device"):
        coalesced_bcast.sync_module(m, src=0)
    assert all(same_bits(a, b) for a, b in zip(before, _snapshot(list(m.parameters()))))
    x = t()
    x[1] = x[1].to_sparse() if rank == 0 else x[1]
    _expect_refusal(rank, world_size, x, 0, names=["d", "s"],
                    match=r"rank 0 refused its input.*tensor 1 \('s'\) on rank 0 is sparse")
    with warnings.catch_warnings():  # nested tensors are a prototype
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        jagged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    x = t() + [nested if rank == 1 else torch.zeros(5)]
    _expect_refusal(rank, world_size, x, 0, match=r"rank 1 refused its input.*tensor 2 on rank 1 is a nested tensor")
    x = t() + [jagged if rank == 0 else torch.zeros(5)]
    _expect_refusal(rank, world_size, x, 0, match=r"rank 0 refused its input.*tensor 2 on rank 0 is (a nested|sparse)")
    # Not a tensor at all.
    x = t() + ([None] if rank == 1 else [torch.zeros(1)])
    _expect_refusal(rank, world_size, x, 0, match=r"rank 1 refused.*tensor 2 on rank 1 is a NoneType")
    # Two overlapping views of one storage, and a view that overlaps itself.
    base = torch.arange(20.0)
    x = [base[0:10], base[5:15]] if rank == 0 else [torch.zeros(10), torch.zeros(10)]
    _expect_refusal(rank, world_size, x, 0, names=["lo", "hi"],
                    match=r"rank 0 refused.*tensor 0 \('lo'\) on rank 0 .* and tensor 1 \('hi'\) on rank 0 .*overlapping")
    x = [torch.zeros(3, 1).expand(3, 4) if rank == 1 else torch.zeros(3, 4)]
    _expect_refusal(rank, world_size, x, 0, match=r"rank 1 refused.*overlaps itself")
    # Mixed devices in one call (cpu and meta are the two this machine has).
    x = [torch.zeros(3), torch.zeros(3, device="meta" if rank == 0 else "cpu")]
    _expect_refusal(rank, world_size, x, 0, match=r"rank 0 refused.*tensor 1 on rank 0 is on the meta device")
    # src outside the group, the same on every rank: raised before anything else.
    _expect_refusal(rank, world_size, t(), 5, match=r"src=5 is not a rank of the group")
    _expect_refusal(rank, world_size, t(), -1, match=r"src=-1 is not a rank of the group")


def _no_backend_and_leaves(rank, world_size):
    t = lambda: [torch.randn(10), torch.randn(3, 4)]  # noqa: E731

    # A group with no backend for the tensors' device: gloo registered for cuda only. Through the store
    # the ranks still agree, and all raise the refusal; a collective agreement has nothing to agree over
    # on a CPU-only machine, so every rank refuses at once, the same way.
    cuda_only = dist.new_group(backend="cuda:gloo")
    x = t()
    before = _snapshot(x)
    with pytest.raises(AgreementError, match=r"rank 0 refused its input.*tensors are on cpu but the process group "
                                             r"\(backend cuda:gloo\) has no backend for cpu") as err:
        coalesced_bcast.broadcast_tensors(x, 0, cuda_only)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, str(err.value))
    assert len(set(gathered)) == 1 and all(same_bits(a, b) for a, b in zip(before, x)), gathered
    del err  # see _COLLECT_NOTE
    os.environ[agree._STORE_ENV] = "0"
    before = _snapshot(x)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"no backend for cpu tensors.*no CUDA device"):
            coalesced_bcast.broadcast_tensors(x, 0, cuda_only)
    finally:
        del os.environ[agree._STORE_ENV]
    assert time.monotonic() - t0 < 5 and all(same_bits(a, b) for a, b in zip(before, x))

    # Empty lists and modules: nothing to send, no error, on every rank; empty on one side only: refused.
    for stats in (coalesced_bcast.broadcast_tensors([], 0, verify=True), coalesced_bcast.sync_module(nn.Module())):
        assert stats.tensors == stats.bytes == stats.buckets == 0
    _expect_refusal(rank, world_size, [] if rank == 0 else [torch.zeros(2)], 0,
                    match=r"the source has 0 tensors, rank 1 has 1: tensor 0 is extra")

    # requires_grad leaves: bytes land, leaves stay leaves with no grad_fn, the version counter moves on
    # receivers (so a graph that saved the old value refuses to backprop through it), autograd works after.
    torch.manual_seed(100 + rank)
    m = Tiny()
    ref = Tiny()
    torch.manual_seed(100)
    ref_src = Tiny()
    if rank == 0:
        m.load_state_dict(ref_src.state_dict())
    stale = (m.lin.weight * m.lin.weight).sum()  # saves the weight for backward
    versions = [p._version for p in m.parameters()]
    coalesced_bcast.sync_module(m, src=0, verify=True)
    for p, q, v in zip(m.parameters(), ref_src.parameters(), versions):
        assert same_bits(p.detach(), q.detach())
        assert p.is_leaf and p.requires_grad and p.grad_fn is None and p.grad is None
        assert (p._version > v) == (rank != 0)
    if rank != 0:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            stale.backward()
    else:
        stale.backward()
        m.zero_grad()
    m.lin(torch.ones(2, 6)).sum().backward()
    assert all(p.grad is not None and p.grad.grad_fn is None for p in m.parameters())
    del ref


def _bad_input_body_checks(rank, world_size):
    _bad_tensors(rank, world_size)
    _no_backend_and_leaves(rank, world_size)


def _bad_input_body(rank, world_size):
    try:
        _bad_input_body_checks(rank, world_size)
    finally:
        gc.collect()  # see _COLLECT_NOTE


def test_bad_input_refused_everywhere():
    run_ranks(2, _bad_input_body)


def _ring_refused_body(rank, world_size):
    """A rank that cannot make its ring (out of memory) before the agreement refuses there: every rank raises
    the same AgreementError naming it, nothing is written, and the next sync goes through."""
    tensors = [_filled((300, 7), torch.float32, rank + i) for i in range(40)]  # small: through the ring
    prepare = _C.Plan.prepare
    if rank == 1:
        def no_memory(plan, is_src):
            raise torch.OutOfMemoryError("out of memory. Tried to allocate 256.00 MiB (a test's refusal)")
        _C.Plan.prepare = no_memory
    try:
        _expect_refusal(rank, world_size, tensors, 0,
                        match=r"rank 1 refused its input.*rank 1 could not make its ring.*Tried to allocate")
    finally:
        _C.Plan.prepare = prepare
    stats = coalesced_bcast.broadcast_tensors(tensors, 0)
    assert stats.buckets > 0
    want = [_filled((300, 7), torch.float32, i) for i in range(40)]
    assert all(same_bits(t, w) for t, w in zip(tensors, want)), f"rank {rank} differs from the source"
    # A ring made for one plan is refused by another's broadcast, locally, before any collective.
    a = _C.Plan(tensors, [], 1 << 20, 2, 1 << 22, 1 << 30, rank)
    b = _C.Plan([t.clone() for t in tensors], [], 1 << 20, 2, 1 << 22, 1 << 30, rank)
    with pytest.raises(RuntimeError, match="a prepared run belongs to another plan"):
        a.broadcast(dist.group.WORLD, 0, prepared=b.prepare(rank == 0))
    gc.collect()  # see _COLLECT_NOTE


def test_a_rank_without_memory_for_its_ring_refuses_in_the_agreement():
    run_ranks(2, _ring_refused_body)


# ---------------------------------------------------------------------------------------------------
# A rank that never arrives or dies: the others fail within the timeout, never hang.

def _record(out_dir, rank, case, t0, err):
    with open(os.path.join(out_dir, f"{case}.{rank}.json"), "w") as f:
        json.dump({"seconds": time.monotonic() - t0, "type": type(err).__name__ if err else None,
                   "message": str(err) if err else None}, f)


def _attempt(out_dir, rank, case, fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what it was is the result
        _record(out_dir, rank, case, t0, e)
    else:
        _record(out_dir, rank, case, t0, None)


def _timeout_body(rank, world_size, out_dir):
    x = [torch.full((1000,), float(rank)), torch.full((70000,), float(rank))]
    # never_calls: rank 1 never calls; rank 0 passes timeout=2 (the group's own is 30 min).
    g = dist.new_group([0, 1])
    if rank == 0:
        _attempt(out_dir, rank, "never_calls", lambda: coalesced_bcast.broadcast_tensors(x, 0, g, timeout=2))
    dist.barrier()
    # never_calls_speculating: the same for a kept plan with speculate=True, once a run went through: rank 0
    # has sent its first bucket before the agreement; its host still raises at the timeout (the broadcast
    # it posted ends with gloo's own timeout, its ring outliving it).
    g = dist.new_group([0, 1])
    plan = coalesced_bcast.plan_sync(x, 0, g, bucket_bytes=4096, inplace_min_bytes=1 << 40, speculate=True)
    plan.run()
    if rank == 0:
        _attempt(out_dir, rank, "never_calls_speculating", lambda: plan.run(timeout=2))
    del plan
    dist.barrier()
    # group_timeout: no timeout argument; the group was made with 2 s.
    g = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 0:
        _attempt(out_dir, rank, "group_timeout", lambda: coalesced_bcast.broadcast_tensors(x, 0, g))
    dist.barrier()
    # stuck_after_agreement: the source agrees, then stops; the receiver waits in the payload broadcast.
    g = dist.new_group([0, 1])
    if rank == 1:
        plan = _C.Plan(x, [], 4096, 2, 1 << 40, 0, rank)
        check_agreement(plan, None, g, 1, [])
    else:
        _attempt(out_dir, rank, "stuck_after_agreement",
                 lambda: coalesced_bcast.broadcast_tensors(x, 1, g, bucket_bytes=4096, timeout=2))
    dist.barrier()
    # killed_mid_run: the source dies (os._exit from another thread) while both loop over syncs.
    g = dist.new_group([0, 1])
    big = [torch.full((1 << 20,), float(rank)) for _ in range(8)]
    if rank == 1:
        threading.Timer(1.0, lambda: os._exit(0)).start()
        while True:
            coalesced_bcast.broadcast_tensors(big, 1, g, bucket_bytes=1 << 16)

    def loop():
        while True:
            coalesced_bcast.broadcast_tensors(big, 1, g, bucket_bytes=1 << 16, timeout=2)
    _attempt(out_dir, rank, "killed_mid_run", loop)
    os._exit(0)  # the group has lost a rank: no teardown


def _died_before_call_body(rank, world_size, out_dir):
    x = [torch.full((1000,), float(rank))]
    dist.barrier()
    if rank == 1:
        os._exit(0)
    _attempt(out_dir, rank, "died_before_call", lambda: coalesced_bcast.broadcast_tensors(x, 0, timeout=3))
    os._exit(0)


def _results(out_dir, case, ranks):
    out = {}
    for r in ranks:
        with open(os.path.join(out_dir, f"{case}.{r}.json")) as f:
            out[r] = json.load(f)
    return out


@pytest.mark.parametrize("store", ["file", "tcp"])
def test_rank_that_never_arrives_or_dies(tmp_path, store):
    run_ranks(2, _timeout_body, str(tmp_path), timeout=90, store=store)
    for case, limit in (("never_calls", 2), ("never_calls_speculating", 2), ("group_timeout", 2)):
        r = _results(tmp_path, case, [0])[0]
        assert r["type"] == "CollectiveError" and r["seconds"] < limit + SLACK_S, (case, r)
        assert r["seconds"] > limit - 0.5, (case, r)  # it was the timeout that ended it
        assert "the agreement over 2 ranks failed on rank 0" in r["message"], r
        assert ("limit: 2 s" if case != "group_timeout" else "limit: the group's timeout") in r["message"], r
    r = _results(tmp_path, "stuck_after_agreement", [0])[0]
    assert r["type"] == "CollectiveError" and r["seconds"] < 2 + SLACK_S, r
    # gloo words its own timeout two ways ("Timed out waiting ...ms for recv", "Operation timed out!")
    assert "the payload broadcast over 2 ranks failed on rank 0" in r["message"], r
    assert "timed out" in r["message"].lower(), r
    r = _results(tmp_path, "killed_mid_run", [0])[0]
    assert r["type"] == "CollectiveError" and r["seconds"] < 1 + 2 + SLACK_S, r


def _torn_store_body(rank, world_size, out_dir):
    # A rank killed while it writes to a FileStore leaves a torn record at the file's end, and torch's
    # FileStore never returns from an operation after that (it spins on the record): the other rank
    # fails at its deadline all the same, and its process still exits.
    x = [torch.full((1000,), float(rank))]
    coalesced_bcast.broadcast_tensors(x, 0, timeout=30)  # the group's agreement state exists
    torn = os.path.join(out_dir, "torn")
    if rank == 1:
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        assert isinstance(store, dist.FileStore), store
        with open(store.path, "ab") as f:
            f.write(struct.pack("I", 2) + b"/t")  # a key whose value never comes
        open(torn, "w").close()
        os._exit(0)
    while not os.path.exists(torn):
        time.sleep(0.01)
    _attempt(out_dir, rank, "torn_store", lambda: coalesced_bcast.broadcast_tensors(x, 0, timeout=2))
    _attempt(out_dir, rank, "torn_store_again", lambda: coalesced_bcast.broadcast_tensors(x, 0, timeout=1))


def test_rank_killed_while_writing_to_the_file_store(tmp_path):
    run_ranks(2, _torn_store_body, str(tmp_path), timeout=60)  # returns: rank 0 exited
    r = _results(tmp_path, "torn_store", [0])[0]
    assert r["type"] == "CollectiveError" and 2 < r["seconds"] < 2 + 1 + SLACK_S, r
    assert "the agreement over 2 ranks failed on rank 0" in r["message"], r
    assert "FileStore did not answer" in r["message"], r
    r = _results(tmp_path, "torn_store_again", [0])[0]
    assert r["type"] == "CollectiveError" and 1 < r["seconds"] < 1 + 1 + SLACK_S, r


def test_store_threads_keep_callers_apart_and_abandon_a_stuck_operation():
    # A FileStore's operations run on helper threads (store_agreement._StoreThread). One that never returns is
    # abandoned at the caller's deadline, and the next call gets another thread.
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.3 s"):
        store_agreement._bounded_store_call(release.wait, (), 0.3)
    assert 0.3 <= time.monotonic() - t0 < 0.3 + SLACK_S
    assert store_agreement._bounded_store_call(lambda x: x + 1, (1,), 5) == 2
    # A long operation (a store wait) on one thread holds up no other thread's.
    slow = threading.Thread(target=store_agreement._bounded_store_call, args=(time.sleep, (3.0,), 10))
    slow.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert store_agreement._bounded_store_call(lambda: "quick", (), 5) == "quick"
    assert time.monotonic() - t0 < 2.0
    slow.join()
    # The operation's own error is the caller's.
    with pytest.raises(KeyError):
        store_agreement._bounded_store_call({}.__getitem__, ("k",), 5)
    release.set()


def test_rank_dead_before_the_call_three_ranks(tmp_path):
    run_ranks(3, _died_before_call_body, str(tmp_path), timeout=60)
    for rank, r in _results(tmp_path, "died_before_call", [0, 2]).items():
        assert r["type"] == "CollectiveError" and r["seconds"] < 3 + SLACK_S, (rank, r)


class _Done:
    """A predicate that turns true after `after` calls (never when None)."""

    def __init__(self, after):
        self.after, self.calls = after, 0

    def __call__(self):
        self.calls += 1
        return self.after is not None and self.calls > self.after


def _host_wait_body(rank, world_size):
    # The host-side deadline that replaces NCCL's process teardown. The C++ loop (_C.poll_until, which
    # _C.wait_stream runs over an event recorded on the device's current stream): a predicate that
    # turns true returns True, one that never does returns False once the deadline passes.
    done = _Done(after=50)
    assert _C.poll_until(done, 5.0) is True and done.calls == 51
    t0 = time.monotonic()
    assert _C.poll_until(_Done(after=None), 0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 5
    assert _C.wait_stream(torch.device("cpu"), 0.0) is True  # nothing is queued on the CPU
    # agree.wait_device: what is left of the deadline goes to the C++ wait, a missed one is a CollectiveError.
    pg = dist.group.WORLD
    asked = []
    real = _C.wait_stream
    try:
        _C.wait_stream = lambda device, seconds: asked.append((device, seconds)) or True
        agree.wait_device(torch.device("cuda", 0), "the test collective", pg, timedelta(seconds=5),
                          time.monotonic() - 1)
        assert asked[0][0] == torch.device("cuda", 0) and 3.5 < asked[0][1] <= 4.0, asked
        _C.wait_stream = lambda device, seconds: False
        with pytest.raises(agree.CollectiveError, match=r"the test collective over 1 ranks did not finish on rank 0 "
                                                       r"within 0\.3 s"):
            agree.wait_device(torch.device("cuda", 0), "the test collective", pg, timedelta(seconds=0.3),
                              time.monotonic())
    finally:
        _C.wait_stream = real
    # a CPU tensor needs no wait
    t = torch.arange(3)
    assert agree.to_host(t, "x", pg, None, time.monotonic()) is t


def test_host_wait_has_a_deadline():
    run_ranks(1, _host_wait_body, timeout=60)


def _gc_body(rank, world_size):
    # Both entry points pause Python's cyclic GC while they run and put the caller's setting back.
    import gc

    model = nn.Linear(4, 4)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            coalesced_bcast.sync_module(model, 0)
            coalesced_bcast.load_full_state_dict(model, model.state_dict(), 0)
            assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_gc_setting_restored():
    run_ranks(1, _gc_body, timeout=60)

"""The pipeline when a broadcast returns a Work that finishes later (the async-Work path).

Before torch 2.8, ProcessGroupNCCL ignores asyncOp = false: each broadcast runs on NCCL's own stream
and the pipeline orders the ring on Work.wait() (see csrc/pipeline.cpp). The CPU analogue here is a
ProcessGroup whose broadcast moves no byte when it is called: the bytes move only when its Work is
waited on (the source's are read then, the receivers' written then). So a pipeline that unpacked a
slot before waiting for its broadcast, or packed the next bucket into a slot whose broadcast had not
been waited for, would deliver wrong bytes, which the bitwise check catches; the log checks, besides,
that every Work is waited on and that no slot is issued again while a Work on it is outstanding.
"""
from __future__ import annotations

import gc
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions

from dist_utils import run_ranks
from zoo import same_bits

from coalesced_bcast import _C

_WorkBase = getattr(dist, "_Work", None) or torch._C._distributed_c10d.Work  # a Python-subclassable Work


class DeferredWork(_WorkBase):
    def __init__(self, run):
        super().__init__()
        self._run, self.done = run, False

    def wait(self, timeout=None):
        if not self.done:
            self._run()
            self.done = True
        return True


class DeferredGroup(dist.ProcessGroup):
    """Broadcasts over a gloo group, but only when the returned Work is waited on."""

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.log: list[tuple[str, int, int]] = []  # (issue|wait, address, bytes)
        self.outstanding: dict[int, int] = {}  # address -> bytes, issued and not yet waited for
        self.overlaps = 0  # issues into memory a Work still outstanding covers
        self.works: list[DeferredWork] = []
        # The C++ core asks the group which devices it serves: cpu, through the gloo backend.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               inner._get_backend(torch.device("cpu")))

    def getBackendName(self):
        return "deferred"

    def broadcast(self, tensors, opts):
        (t,) = tensors
        addr, n = t.data_ptr(), t.numel() * t.element_size()
        if any(a < addr + n and addr < a + m for a, m in self.outstanding.items()):
            self.overlaps += 1
        self.outstanding[addr] = n
        self.log.append(("issue", addr, n))
        root = opts.rootRank

        def run():
            self.log.append(("wait", addr, n))
            del self.outstanding[addr]
            o = BroadcastOptions()
            o.rootRank = root
            self.inner.broadcast([t], o).wait()
        work = DeferredWork(run)
        # The C++ caller holds only the C++ half: pybind finds the Python wait() through the Python
        # object, which must stay alive (else torch's base Work::wait runs and never sees completion).
        self.works.append(work)
        return work


def _values(rank: int, n: int, size: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    want = [torch.randn(size + i, generator=g).to(dtype) for i in range(n)]
    return want if rank == 0 else [torch.full_like(w, -1) for w in want]


def _body(rank, world_size):
    try:
        pg = DeferredGroup(dist.new_group(list(range(world_size))))
        want = _values(0, 40, 300)
        # Buckets: 40 tensors of ~1.2 kB in 4 kB buckets, a ring of 2 slots: each slot is reused many times.
        mine = _values(rank, 40, 300)
        plan = _C.Plan(mine, [], 4096, 2, 1 << 40, 1 << 40, rank)
        plan.broadcast(pg, 0, 30.0)
        assert all(same_bits(a, b) for a, b in zip(mine, want)), rank
        issues = [e for e in pg.log if e[0] == "issue"]
        waits = [e for e in pg.log if e[0] == "wait"]
        assert len(issues) == len(waits) >= 10, pg.log  # every Work waited on; many buckets through 2 slots
        assert not pg.outstanding and pg.overlaps == 0, (pg.outstanding, pg.overlaps)
        slots = {a for _, a, _ in issues}
        assert len(slots) == 2, slots  # the ring: its two slots, reused
        assert len(issues) == plan.num_buckets
        # In place (no ring), tensors at least inplace_min_bytes each, and a mix of both, with a timeout
        # (the host waits for each Work against the call's deadline).
        for inplace_min in (0, 2048):
            pg.log.clear()
            mine = _values(rank, 12, 400 if inplace_min else 100) + _values(rank, 12, 700)[:3]
            want = _values(0, 12, 400 if inplace_min else 100) + _values(0, 12, 700)[:3]
            plan = _C.Plan(mine, [], 4096, 2, inplace_min, 1 << 40, rank)
            plan.broadcast(pg, 0, 30.0)
            assert all(same_bits(a, b) for a, b in zip(mine, want)), (rank, inplace_min)
            assert sum(e[0] == "issue" for e in pg.log) == sum(e[0] == "wait" for e in pg.log) > 0
            assert not pg.outstanding and pg.overlaps == 0
    finally:
        gc.collect()


def test_async_works_are_waited_before_their_slot_is_used_again():
    run_ranks(2, _body, timeout=120)

"""agree's one record and verdict, its exchanges and its broadcasts, over the store and as collectives: what
the front-ends (sync, load, refit, verify) build their agreements on."""
import gc
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from coalesced_bcast import agree
from coalesced_bcast.agree import OK, REFUSED, Agreement, Record
from dist_utils import run_ranks

_AFTER = 2  # a front-end's own status (the load's "strict after the hooks")


def _rounds(rank, world_size, pg):
    last = world_size - 1
    every = agree.verdict(Record(OK, 7, 3), pg)
    assert every.agreed and [r.digest for r in every.records] == [7] * world_size
    # Another status on one rank: no agreement, and every rank sees every rank's record.
    v = agree.verdict(Record(_AFTER if rank == last else OK, 7, 3), pg)
    assert not v.agreed and v.refused() is None and v.statuses() == {OK, _AFTER} and v.differ(0) == []
    # A digest that differs from the source's, and a count.
    v = agree.verdict(Record(OK, 7 + (rank == last), 3), pg)
    assert not v.agreed and v.differ(0) == [last] and v.records[last].digest == 8
    v = agree.verdict(Record(OK, 7, 3 + rank), pg)
    assert v.differ(0) == list(range(1, world_size)) and [r.count for r in v.records] == [3 + r for r in
                                                                                           range(world_size)]
    # Refusals: the lowest rank's words on every rank; a message too long for the record is cut and marked.
    long = "x" * 5000
    v = Agreement(pg, size=4096).verdict(Record(REFUSED if rank else OK, message=f"rank {rank}: {long}"))
    r, msg = v.refused()
    assert r == 1 and msg.startswith("rank 1: xxx") and msg.endswith(" [...]") and len(msg.encode()) <= 4096 - 24
    v = agree.verdict(Record(REFUSED, message=f"no {rank}"), pg)
    assert not v.agreed and v.refused() == (0, "no 0")


def _exchanges(rank, world_size, pg):
    a = Agreement(pg)
    assert not a.verdict(Record(OK, rank)).agreed
    got = a.exchange(torch.tensor([rank, 10 + rank], dtype=torch.uint8))
    assert [t.tolist() for t in got] == [[r, 10 + r] for r in range(world_size)]
    assert a.share(b"from 1" if rank == 1 else None, 1) == b"from 1"
    assert a.verdict(Record(OK)).agreed


def _broadcasts(rank, world_size, pg):
    big = bytes(range(256)) * (6 << 10)  # more than one metadata chunk
    for blob in (big, b""):
        out = agree.broadcast_bytes(blob if rank == 1 else None, pg, 1)
        assert bytes(out) == blob
    obj = {"names": ["a", "b"], "units": torch.arange(6).reshape(2, 3)}
    got = agree.broadcast_object(obj if rank == 0 else None, pg, 0)
    assert got["names"] == obj["names"] and torch.equal(got["units"], obj["units"])
    assert pickle.loads(agree.broadcast_bytes(pickle.dumps(7) if rank == 0 else None, pg, 0)) == 7
    rec = agree.broadcast_record(Record(REFUSED, 5, 6, "why") if rank == 0 else None, pg, 0)
    assert rec == Record(REFUSED, 5, 6, "why")


def _body(rank, world_size, store_max):
    try:
        os.environ[agree._STORE_ENV] = store_max
        pg = dist.group.WORLD
        for check in (_rounds, _exchanges, _broadcasts):
            check(rank, world_size, pg)
        del os.environ[agree._STORE_ENV]
    finally:
        gc.collect()


@pytest.mark.parametrize("world_size,store,store_max", [(2, "tcp", "64"), (2, "file", "64"), (3, "tcp", "64"),
                                                        (3, "file", "0")])
def test_records_verdicts_and_broadcasts(world_size, store, store_max):
    """store_max "64": rounds through the group's store (two ranks: a queue on a TCPStore, keys on a FileStore;
    three: a counter); "0": as collectives."""
    run_ranks(world_size, _body, store_max, store=store)

"""The host stage (a load's source packing host-memory runs with several threads), without a GPU: the
threaded pack must equal a plain concatenation of each tensor's bytes in logical order, whatever the
thread count, with large runs cut between threads and strided runs kept whole."""
import pytest
import torch

from coalesced_bcast import _C


def _expected(tensors):
    out, offset = [], 0
    for t in tensors:
        pad = -offset % 16
        out.append(torch.zeros(pad, dtype=torch.uint8))
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        out.append(raw)
        offset += pad + raw.numel()
    return torch.cat(out)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threaded_pack_equals_concatenation(threads):
    g = torch.Generator().manual_seed(threads)
    tensors = [
        torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8),      # cut between threads
        torch.randn(1000, 700, generator=g).t(),                                 # strided: kept whole
        torch.randint(-9, 9, (5,), generator=g, dtype=torch.int64),
        torch.randn(0, generator=g),
        torch.randn(2 << 20, generator=g).to(torch.bfloat16),
        torch.randn(64, 3, 50, generator=g).permute(2, 0, 1),
        torch.randint(0, 2, (17,), generator=g).bool(),
    ] + [torch.randn(int(n), generator=g) for n in torch.randint(1, 5000, (300,), generator=g)]
    got, shares = _C._host_stage(tensors, threads)
    assert torch.equal(got, _expected(tensors))
    # Shared out over the threads (the workers start at the first shared pack: once the decision read the
    # workers already started, and nothing was ever shared).
    assert shares == 1 if threads == 1 else 1 < shares <= threads, shares


def _unit_row(t):
    from coalesced_bcast._util import _dtype_code
    row = torch.zeros(10, dtype=torch.int64)
    row[0], row[1] = _dtype_code(t.dtype), t.dim()
    row[2:2 + t.dim()] = torch.tensor(t.shape)
    return row


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_threaded_unstage_writes_each_box(threads):
    """The other direction (a rank with pageable host shards): a load plan's scatter runs written out of the
    byte stream by several threads land exactly in each destination's box, cast as torch's CPU cast, with
    large byte runs cut between threads and across buckets."""
    g = torch.Generator().manual_seed(threads)
    full = [
        torch.randint(-2**31, 2**31 - 1, (3 << 20,), generator=g, dtype=torch.int32).view(torch.float32),
        torch.randn(96, 70, generator=g),                             # columns [20, 55) of it: a boxed run
        torch.randn(5000, generator=g).to(torch.bfloat16),            # into float32: a cast run
        torch.randint(-9, 9, (33, 3), generator=g, dtype=torch.int64),  # rows [11, 22)
        torch.randint(0, 2, (17,), generator=g).bool(),
        torch.randn(2 << 18, generator=g),                            # into bfloat16, whole
    ]
    boxes = [None, (1, 20, 55), None, (0, 11, 22), None, None]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.int64, torch.bool, torch.bfloat16]
    dests, meta, want = [], torch.zeros((len(full), 9), dtype=torch.int64), []
    for i, (t, box, dt) in enumerate(zip(full, boxes, dtypes)):
        part = t if box is None else t.narrow(box[0], box[1], box[2] - box[1])
        meta[i, 0] = i
        if box is not None:
            meta[i, 1 + box[0]] = box[1]
        want.append(part.to(dt))
        dests.append(torch.zeros(part.shape, dtype=dt))
    units = torch.stack([_unit_row(t) for t in full])
    B = 4 << 20  # a share is at least 1 MiB: several to a bucket
    plan = _C.load_plan(units, [], list(dests), meta, B, 2, 0, threads, torch.device("cpu"))
    stream = torch.zeros(plan.num_buckets * B, dtype=torch.uint8)
    offset = 0
    for t in full:
        offset += -offset % 16
        raw = t.reshape(-1).view(torch.uint8)
        stream[offset:offset + raw.numel()] = raw
        offset += raw.numel()
    assert plan.num_buckets >= 4
    shares = _C._host_scatter(plan, stream, threads)
    assert shares == 1 if threads == 1 else 1 < shares <= threads, shares
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
    for i, (got, w) in enumerate(zip(dests, want)):
        if w.is_floating_point():  # NaN payloads: torch's own CPU cast keeps one or another (vector or tail)
            nan = w.isnan()
            assert torch.equal(got.isnan(), nan), i
            got, w = got[~nan], w[~nan]
        assert torch.equal(got.view(bits.get(got.dtype, got.dtype)), w.view(bits.get(w.dtype, w.dtype))), \
            f"destination {i}"


def test_source_plan_of_many_tensors_names_the_bad_one_from_either_pass():
    """On the source, a plan of many tensors reads its checkpoint tensors (pack runs) and its destinations
    (scatter runs) side by side: the same plan as one pass after the other would make, and a problem in
    either raised as a Python error naming the tensor, never lost or ending the process."""
    g = torch.Generator().manual_seed(0)
    n = 1500  # above the count where the pack pass gets a thread of its own
    sources = [torch.randn(int(k), generator=g) for k in torch.randint(1, 300, (n,), generator=g)]
    units = torch.stack([_unit_row(t) for t in sources])
    meta = torch.zeros((n, 9), dtype=torch.int64)
    meta[:, 0] = torch.arange(n)
    B = 4096

    def plan(srcs, dests):
        return _C.load_plan(units, list(srcs), list(dests), meta, B, 2, 0, 1, torch.device("cpu"))

    dests = [torch.zeros_like(t) for t in sources]
    full = plan(sources, dests)
    receiver = plan([], [torch.zeros_like(t) for t in sources])
    assert full.num_buckets == receiver.num_buckets > 100
    assert full.num_units_sent == n and full.total_bytes == sum(t.numel() * 4 for t in sources)
    stream = torch.zeros(full.num_buckets * B, dtype=torch.uint8)
    offset = 0
    for t in sources:
        offset += -offset % 16
        stream[offset:offset + t.numel() * 4] = t.view(torch.uint8)
        offset += t.numel() * 4
    assert torch.equal(_C._host_stage(sources, 2)[0][:offset], stream[:offset])  # what the source packs
    _C._host_scatter(full, stream, 2)
    assert all(torch.equal(d, s) for d, s in zip(dests, sources))

    bad_source = list(sources)
    bad_source[1400] = sources[1400].double()
    with pytest.raises(ValueError, match="checkpoint tensor 1400 on source rank 0 is Double"):
        plan(bad_source, [torch.zeros_like(t) for t in sources])
    bad_dest = [torch.zeros_like(t) for t in sources]
    bad_dest[1200] = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="destination 1200 on rank 0 has 2 dims"):
        plan(sources, bad_dest)
    with pytest.raises(ValueError, match="checkpoint tensor 1400|destination 1200"):  # both: one of them
        plan(bad_source, bad_dest)

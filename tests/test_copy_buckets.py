"""The copy table both ways on one device, no communication: one plan packs a state into a slot bucket by
bucket, a second plan over tensors of the same layout unpacks it, and the second state must end bitwise
equal to the first. On CPU this is the host copier; on a GPU the pack and unpack kernels (many runs per
window, runs split across buckets, strided and unaligned tensors beside aligned ones).
"""
import pytest
import torch

from coalesced_bcast import _C
from zoo import fill_random_bytes, make_zoo, same_bits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _plan(tensors, bucket_bytes):
    # inplace_min_bytes out of reach: every tensor goes through the buckets
    return _C.Plan(list(tensors), [], bucket_bytes, 2, 1 << 50, 1 << 30, 0)


def _move(src, dst, bucket_bytes):
    """Pack `src` bucket by bucket, unpack each into `dst`; returns the number of buckets."""
    a, b = _plan(src, bucket_bytes), _plan(dst, bucket_bytes)
    assert torch.equal(a.fingerprint(), b.fingerprint()) and a.num_buckets == b.num_buckets
    slot = torch.empty(a.slot_bytes, dtype=torch.uint8, device=src[0].device)
    for k in range(a.num_buckets):
        slot.fill_(0xA5)  # bytes of another bucket must not survive
        _C._copy_buckets(a, True, slot, [k])
        _C._copy_buckets(b, False, slot, [k])
    if slot.is_cuda:
        torch.cuda.synchronize()
    return a.num_buckets


def _small_mix(device, gen, values):
    """Tensors of 1 B .. 5 KiB, some at odd offsets or strided, so that a 32 KiB window holds dozens of runs
    and one thread's units fall in several of them."""
    out = []
    shape_gen = torch.Generator().manual_seed(11)
    for i in range(600):
        n = int(torch.randint(1, 5000, (1,), generator=shape_gen))
        kind = i % 5
        if kind == 3:  # a view one byte in: copied narrower than 16-byte words
            base = torch.empty(n + 1, dtype=torch.uint8, device=device)
            t = base[1:]
        elif kind == 4 and n > 8:  # strided: element by element
            base = torch.empty(n // 4 + 1, 2, dtype=torch.float16, device=device)
            t = base[:, 1]
        else:
            t = torch.empty((n + 3) // 4, dtype=torch.float32, device=device)
        fill_random_bytes(t if t.is_contiguous() else base, values)
        out.append(t)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_zoo_moves_bitwise_through_pack_and_unpack(device, bucket_bytes):
    dev = torch.device(device)
    src = [t for _, t in make_zoo(3, dev, 3 * bucket_bytes // 2, value_seed=1)]
    dst = [t for _, t in make_zoo(3, dev, 3 * bucket_bytes // 2, value_seed=2)]
    assert not all(same_bits(a, b) for a, b in zip(src, dst))
    buckets = _move(src, dst, bucket_bytes)
    assert buckets > 1
    for i, (a, b) in enumerate(zip(src, dst)):
        assert same_bits(a, b), f"tensor {i} differs after pack and unpack ({a.shape}, {a.dtype}, {a.stride()})"


@pytest.mark.parametrize("device", DEVICES)
def test_many_small_runs_per_window_move_bitwise(device):
    dev = torch.device(device)
    src = _small_mix(dev, None, torch.Generator().manual_seed(1))
    dst = _small_mix(dev, None, torch.Generator().manual_seed(2))
    _move(src, dst, 256 << 10)
    for i, (a, b) in enumerate(zip(src, dst)):
        assert same_bits(a, b), f"tensor {i} differs ({a.shape}, stride {a.stride()}, offset {a.storage_offset()})"


def test_slot_and_bucket_are_checked():
    t = [torch.zeros(100)]
    p = _plan(t, 4096)
    with pytest.raises(ValueError, match="slot of at least"):
        _C._copy_buckets(p, True, torch.empty(16, dtype=torch.uint8), [0])
    with pytest.raises(ValueError, match="a bucket of 1, got 1"):
        _C._copy_buckets(p, True, torch.empty(p.slot_bytes, dtype=torch.uint8), [1])

"""verify: the per-tensor hash against a pure-Python reference and its bit sensitivity, the host-side
bounds check of the copy table, and the cross-rank check over gloo (every rank raises, naming the
tensor and the rank that differs)."""
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

import coalesced_bcast
from coalesced_bcast import _C, agree
from coalesced_bcast.verify import VerifyError, tensor_hashes, verify_tensors
from dist_utils import run_ranks
from zoo import DTYPES, bits, fill_random_bytes, make_zoo, same_bits

M = (1 << 64) - 1
K_WORD, K_SIZE = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F

# _COLLECT_NOTE: pytest.raises keeps exceptions whose frames hold the process group; a group object that
# outlives destroy_process_group and dies at interpreter exit can abort the process (seen with gloo:
# "terminate called without an active exception"), so each body breaks those cycles before returning.


def fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M
    return k ^ (k >> 33)


def logical_bytes(t: torch.Tensor) -> bytes:
    return bits(t.contiguous()).reshape(-1).view(torch.uint8).numpy().tobytes()


def ref_hash(t: torch.Tensor) -> int:
    """csrc/verify.h, written out: words in logical order, each mixed with its index, summed."""
    raw = logical_bytes(t)
    s = 0
    for i in range((len(raw) + 7) // 8):
        w = int.from_bytes(raw[8 * i:8 * i + 8], "little")
        s = (s + fmix((w + (i + 1) * K_WORD) & M)) & M
    return fmix((s + fmix(len(raw) ^ K_SIZE)) & M)


def ref_digest(hashes: list[int]) -> int:
    d = 0
    for i, h in enumerate(hashes):
        d = (d + fmix((h + (i + 1) * K_SIZE) & M)) & M
    return fmix(d ^ fmix((len(hashes) + K_WORD) & M))


def hashes_of(tensors) -> list[int]:
    return [v & M for v in tensor_hashes(tensors).tolist()]


def test_hash_matches_reference():
    g = torch.Generator().manual_seed(0)
    tensors = []
    for dtype in DTYPES:
        base = torch.empty((37, 12), dtype=dtype)
        fill_random_bytes(base, g)
        tensors += [base, base.t(), base[:, ::5], base.view(-1)[3:40], base[0, 0], base[:0]]
    big = torch.empty(3 * 65536 // 4 + 7, dtype=torch.float32)  # several 64 KiB chunks, a partial last word
    fill_random_bytes(big, g)
    nine = torch.empty([2] * 9 + [3], dtype=torch.int16)  # more strided dims than the kernel walks
    fill_random_bytes(nine, g)
    tensors += [big, big[1:], nine.transpose(0, 9), torch.empty(0, dtype=torch.bool)]
    got = hashes_of(tensors)
    want = [ref_hash(t) for t in tensors]
    assert got[:-1] == want, [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert got[-1] == ref_digest(want)
    assert hashes_of([]) == [ref_digest([])]


def test_hash_follows_logical_order_not_memory():
    g = torch.Generator().manual_seed(1)
    x = torch.empty(50, 70, dtype=torch.bfloat16)
    fill_random_bytes(x, g)
    other_layout = x.t().contiguous().t()  # same values, column-major memory
    assert other_layout.stride() != x.stride()
    a, b, c = hashes_of([x, other_layout, x.t()])[:3]
    assert a == b and a != c  # the transpose has other values in logical order


def test_every_single_bit_flip_is_detected():
    g = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        t = torch.empty(300, dtype=dtype)
        fill_random_bytes(t, g)
        h0 = hashes_of([t])[0]
        raw = bits(t).view(-1).view(torch.uint8)
        for pos in torch.randint(0, raw.numel(), (24,), generator=g).tolist():
            for bit in (0, 7) if dtype != torch.bool else (0,):
                u = t.clone()
                bits(u).view(-1).view(torch.uint8)[pos] ^= 1 << bit
                assert hashes_of([u])[0] != h0, (dtype, pos, bit)
    z = torch.zeros(8)
    nz = z.clone()
    nz[5] = -0.0
    nan_a = torch.full((8,), float("nan"))
    nan_b = nan_a.clone()
    nan_b.view(torch.int32)[3] ^= 1  # another NaN payload
    h = hashes_of([z, nz, nan_a, nan_b])
    assert h[0] != h[1] and h[2] != h[3]
    assert torch.equal(z, nz) and not same_bits(z, nz)  # value-equal, bit-different: only bits count


def test_digest_sees_order_and_count():
    a, b = torch.arange(5.0), torch.arange(5.0) + 1
    assert hashes_of([a, b])[-1] != hashes_of([b, a])[-1]
    assert hashes_of([a])[-1] != hashes_of([a, torch.empty(0)])[-1]


def test_hash_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="tensor 1 .*not a dense tensor"):
        tensor_hashes([torch.zeros(2), torch.zeros(2, device="meta")])
    with pytest.raises(ValueError, match="tensor 1 .*not a dense tensor"):
        tensor_hashes([torch.zeros(2), torch.eye(3).to_sparse()])


CORRUPTIONS = {
    "unaligned_offset": "bucket offset unaligned",
    "past_bucket": "runs past bucket",
    "past_tensor": "runs past its tensor",
    "foreign_pointer": "does not point at its packed tensor",
    "bad_owner": "owner out of range",
    "bad_layout": "has layout",
    "op_range": "op range out of bounds",
    "bucket_over_slot": "slot",
    "split_element": "splits an element",
}


def test_copy_table_is_bounds_checked_before_launch():
    """validate_copy_table (csrc/plan.cpp) runs on every plan before any launch; each corruption of a
    copy table is caught by it, and a sound table passes."""
    zoo = make_zoo(3, torch.device("cpu"), 4096, value_seed=0)
    plan = _C.Plan([t for _, t in zoo], [n for n, _ in zoo], 4096, 2, 1 << 40, 0, 0)
    assert plan.num_buckets > 3
    assert _C._check_corrupted_table(plan, "none") == ""
    for what, message in CORRUPTIONS.items():
        got = _C._check_corrupted_table(plan, what)
        assert message in got, (what, got)


def test_bucket_table_covers_every_byte_once():
    """What validate_copy_table guarantees, checked independently from Python on a zoo plan."""
    zoo = make_zoo(4, torch.device("cpu"), 4096, value_seed=0)
    plan = _C.Plan([t for _, t in zoo], [], 4096, 2, 1 << 40, 0, 0)
    covered: dict[int, list[tuple[int, int]]] = {}
    for nbytes, ops in plan.bucket_table():
        end = 0
        for unique, t_off, b_off, n, _ in ops:
            assert b_off % 16 == 0 and b_off >= end and b_off + n <= nbytes and n > 0
            end = b_off + n
            covered.setdefault(unique, []).append((t_off, n))
    for u, first in enumerate(plan.unique_first_input):
        t = zoo[first][1]
        want = t.numel() * t.element_size()
        runs = sorted(covered.get(u, []))
        pos = 0
        for off, n in runs:
            assert off == pos
            pos += n
        assert pos == want, (zoo[first][0], pos, want)


def _verify_body_checks(rank, world_size, out_dir):
    device = torch.device("cpu")
    pg = dist.group.WORLD
    for src in (0, world_size - 1):
        zoo = make_zoo(7, device, 4096, value_seed=100 + src if rank == src else 900 + rank)
        names, tensors = [n for n, _ in zoo], [t for _, t in zoo]
        coalesced_bcast.broadcast_tensors(tensors, src, names=names, bucket_bytes=4096, verify=True)
        seq1 = pg._get_sequence_number_for_group()
        stats = verify_tensors(tensors, src, names=names)
        seq2 = pg._get_sequence_number_for_group()
        assert seq2 - seq1 == 0, "verify through the group's store must cost no collective when all is well"
        os.environ[agree._STORE_ENV] = "0"  # groups beyond the store's limit agree through a collective
        try:
            seq1 = pg._get_sequence_number_for_group()
            verify_tensors(tensors, src, names=names)
            seq2 = pg._get_sequence_number_for_group()
            assert seq2 - seq1 == 1, "verify as a collective must cost exactly one collective when all is well"
        finally:
            del os.environ[agree._STORE_ENV]
        assert stats.tensors == len(tensors) and stats.bytes > 0

        messages = []
        target = world_size - 1 if src == 0 else 0  # a receiver
        for name in ("uint8.small", "float64.strided", "float32.small", "tied.alias"):
            k = names.index(name)
            t = tensors[k]
            if name == "float64.strided":  # +0.0 everywhere, then -0.0 on one rank: equal values, other bits
                t[0, 1] = 0.0
            saved = t.clone()
            if rank == target:
                if name == "float64.strided":
                    t[0, 1] = -0.0
                elif name == "float32.small":
                    t.view(torch.int32)[0] = 0x7FC00123  # a NaN with a payload
                else:
                    t.view(-1).view(torch.uint8)[t.numel() // 2] ^= 1  # one bit
                assert not same_bits(t, saved)
            t0 = time.monotonic()
            with pytest.raises(VerifyError) as err:
                verify_tensors(tensors, src, names=names)
            assert time.monotonic() - t0 < 10
            msg = str(err.value)
            # tied.alias shares its bytes with tied.a and tied.b: all three differ, the first is named
            tied = sorted(names.index(n) for n in ("tied.a", "tied.b", "tied.alias"))
            first, count = (tied[0], 3) if name == "tied.alias" else (k, 1)
            assert f"tensor {first} ('{names[first]}')" in msg and f"rank(s) [{target}]" in msg, msg
            assert f"source rank {src}" in msg and f"{count} tensor(s) differ" in msg, msg
            messages.append(msg)
            t.copy_(saved)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, messages)
        assert all(g == messages for g in gathered), gathered

    # Ranks that pass different numbers of tensors learn it from the same single agreement round.
    with pytest.raises(VerifyError, match="passed between 2 and 3 tensors"):
        verify_tensors([torch.zeros(3)] * (3 if rank == 0 else 2))
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        f.write("ok")


def _verify_body(rank, world_size, out_dir):
    try:
        _verify_body_checks(rank, world_size, out_dir)
    finally:
        gc.collect()  # see _COLLECT_NOTE


@pytest.mark.parametrize("world_size", [2, 3])
def test_verify_across_ranks(world_size, tmp_path):
    run_ranks(world_size, _verify_body, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [f"ok{r}" for r in range(world_size)]

"""The CUDA kernels and the host stage on one GPU (a group of one rank over NCCL): a load whose
checkpoint mixes GPU, pinned and pageable tensors in the same buckets (runs packed on the device,
copied straight from pinned memory and staged by threads), strided sources, a transposed destination
(the scatter kernel's boxed path) and casts, bitwise against torch's own CUDA copy_.

Skipped without a GPU; bench/device_run.sh runs it (gputest).
"""
import os

import pytest
import torch
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")


def _mixed_body(rank, world_size, pinned_only=False):
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(4)
    shapes = [(300, 1024), (7,), (256, 257), (1000,), (64, 4096), (3, 5, 7)] + [(50 + i,) for i in range(120)]
    full = {}
    for i, shape in enumerate(shapes):
        t = torch.empty(shape, dtype=torch.bfloat16 if i % 4 else torch.float32)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        full[f"p{i}"] = t
    kinds = [lambda v: v.to(dev), lambda v: v.pin_memory(), lambda v: v,
             lambda v: v.t().contiguous().t() if v.dim() == 2 else v]  # device, pinned, pageable, strided
    strided_pinned = {"p2"}  # 131 KB, read element by element by the copy kernel
    if pinned_only:  # every host run pinned: p0's large runs by the copy engine, the others by the copy kernel
        kinds = [lambda v: v.pin_memory()]
    for cast in (False, True):
        model = nn.Module()
        for k, v in full.items():
            dtype = torch.bfloat16 if cast else v.dtype
            p = torch.full(v.shape, -1.0, dtype=dtype, device=dev)
            if k == "p2":  # a transposed destination: written through the boxed path
                p = torch.full(v.shape[::-1], -1.0, dtype=dtype, device=dev).t()
            model.register_parameter(k, nn.Parameter(p))
        sd = {k: kinds[i % len(kinds)](v) for i, (k, v) in enumerate(full.items())}
        if pinned_only:
            sd.update({k: full[k].t().contiguous().t().pin_memory() for k in strided_pinned})
            assert all(v.is_pinned() for v in sd.values()) and not sd["p2"].is_contiguous()
        stats = coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=256 << 10, copy_threads=3)
        torch.cuda.synchronize()
        for k, v in full.items():
            got = getattr(model, k)
            want = v.to(dev).to(got.dtype)  # torch's own CUDA cast
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                f"cast {cast}: '{k}' differs"
        assert stats.buckets == 10 and stats.cast_keys == (sum(v.dtype != torch.bfloat16 for v in full.values())
                                                          if cast else 0)
        # p0 (1.2 MB on the GPU) spans several buckets: those inside it go straight from it (direct buckets),
        # and the source's own scatter reads them there, casting when asked
        assert stats.direct_buckets >= 3 or pinned_only, stats
        if pinned_only:  # the host ring is only made for runs that the copy kernel does not read
            staged = os.environ.get("COALESCED_BCAST_HOST_READ") == "stage"
            assert (stats.host_ring_bytes > 0) == staged, stats


@pytest.mark.parametrize("copy_blocks", [None, "2"])
def test_load_mixed_sources_on_one_gpu(copy_blocks, monkeypatch):
    """copy_blocks: the copy kernels' grid capped at 2 blocks (each strides over many windows)."""
    if copy_blocks:
        monkeypatch.setenv("COALESCED_BCAST_COPY_BLOCKS", copy_blocks)
    run_ranks(1, _mixed_body, backend="nccl", timeout=200)


@pytest.mark.parametrize("host_read", [None, "stage"])
def test_load_pinned_sources_on_one_gpu(host_read, monkeypatch):
    """Every source tensor pinned (contiguous and strided, small and large): the copy kernel reads the
    small and strided runs from host memory, the copy engine the large ones; host_read=stage: the small
    ones through the host ring instead (COALESCED_BCAST_HOST_READ, the bench's A/B switch)."""
    if host_read:
        monkeypatch.setenv("COALESCED_BCAST_HOST_READ", host_read)
    run_ranks(1, _mixed_body, True, backend="nccl", timeout=200)


def _overwrite_after_return_body(rank, world_size):
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(9)
    # Large contiguous pinned tensors only: every run goes up by the copy engine straight from the caller's
    # memory (no host ring, no kernel reads), ~10 ms of copies on an H200.
    full = {f"w{i}": torch.randint(-2**15, 2**15, (128 << 20,), dtype=torch.int16, device=dev, generator=g)
            for i in range(2)}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros_like(v), requires_grad=False))
    sd = {k: v.cpu().pin_memory() for k, v in full.items()}
    torch.cuda.synchronize()
    stats = coalesced_bcast.load_full_state_dict(model, sd)
    # The caller may reuse its tensors once the call returns: the load must not read them any more. The last
    # tensor first, which the copies reach last.
    for v in reversed(list(sd.values())):
        v.fill_(0)
    torch.cuda.synchronize()
    assert stats.host_ring_bytes == 0, stats
    for k, v in full.items():
        assert torch.equal(getattr(model, k), v), f"'{k}' holds bytes written into the source after the load returned"


def test_load_from_pinned_memory_is_done_with_it_on_return():
    run_ranks(1, _overwrite_after_return_body, backend="nccl", timeout=200)

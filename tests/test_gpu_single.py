"""The CUDA kernels and the host stage on one GPU (a group of one rank over NCCL): a load whose
checkpoint mixes GPU, pinned and pageable tensors in the same buckets (runs packed on the device,
copied straight from pinned memory and staged by threads), strided sources, a transposed destination
(the scatter kernel's boxed path) and casts, bitwise against torch's own CUDA copy_.

Skipped without a GPU; bench/device_run.sh runs it (gputest).
"""
import pytest
import torch
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")


def _mixed_body(rank, world_size):
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
    for cast in (False, True):
        model = nn.Module()
        for k, v in full.items():
            dtype = torch.bfloat16 if cast else v.dtype
            p = torch.full(v.shape, -1.0, dtype=dtype, device=dev)
            if k == "p2":  # a transposed destination: written through the boxed path
                p = torch.full(v.shape[::-1], -1.0, dtype=dtype, device=dev).t()
            model.register_parameter(k, nn.Parameter(p))
        sd = {k: kinds[i % 4](v) for i, (k, v) in enumerate(full.items())}
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
        assert stats.direct_buckets >= 3, stats


@pytest.mark.parametrize("copy_blocks", [None, "2"])
def test_load_mixed_sources_on_one_gpu(copy_blocks, monkeypatch):
    """copy_blocks: the copy kernels' grid capped at 2 blocks (each strides over many windows)."""
    if copy_blocks:
        monkeypatch.setenv("COALESCED_BCAST_COPY_BLOCKS", copy_blocks)
    run_ranks(1, _mixed_body, backend="nccl", timeout=200)

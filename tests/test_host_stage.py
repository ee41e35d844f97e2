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
    got = _C._host_stage(tensors, threads)
    assert torch.equal(got, _expected(tensors))

"""A seeded zoo of tensors covering every case the sync must get bitwise right, and bit-level helpers."""
from __future__ import annotations

import torch

from coalesced_bcast.bits import as_int as bits  # equality of these is bitwise: NaN payloads, -0.0 and all

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a).cpu(), bits(b).cpu())


def fill_random_bytes(base: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (NaNs with payloads, denormals, ...); bools stay 0/1 so they remain valid bools."""
    raw = torch.randint(0, 256, (base.numel() * base.element_size(),), dtype=torch.uint8, generator=gen)
    if base.dtype == torch.bool:
        raw &= 1
    base.view(-1).view(torch.uint8).copy_(raw.to(base.device))


def make_zoo(seed: int, device: torch.device, big_bytes: int, value_seed: int) -> list[tuple[str, torch.Tensor]]:
    """Same structure for the same `seed` on every rank; values from `value_seed`.

    Covers every dtype, 0-dim and 0-element tensors, non-contiguous views (transposed, strided,
    interleaved views of one base), views at unaligned offsets, tensors larger than `big_bytes`
    (a bucket), and tied entries (the same tensor twice, and a reshaped alias of the same bytes).
    """
    shape_gen = torch.Generator().manual_seed(seed)
    value_gen = torch.Generator().manual_seed(value_seed)
    out: list[tuple[str, torch.Tensor]] = []

    def new(shape, dtype):
        t = torch.empty(shape, dtype=dtype, device=device)
        fill_random_bytes(t, value_gen)
        return t

    def rint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=shape_gen))

    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        es = torch.empty((), dtype=dtype).element_size()
        out.append((f"{name}.scalar", new((), dtype)))
        out.append((f"{name}.empty", new((0, rint(1, 4)), dtype)))
        out.append((f"{name}.small", new((rint(1, 300),), dtype)))
        out.append((f"{name}.transposed", new((rint(2, 40), rint(2, 40)), dtype).t()))
        out.append((f"{name}.strided", new((rint(2, 30), rint(4, 30)), dtype)[:, ::3]))
        big = big_bytes // es + rint(1, 2000)
        out.append((f"{name}.big", new((big,), dtype)))
        out.append((f"{name}.big_strided", new((2, big), dtype)[1]))  # contiguous, offset by a row
        base = new((rint(2, 20), 2 * rint(2, 20)), dtype)
        out.append((f"{name}.even", base[:, 0::2]))
        out.append((f"{name}.odd", base[:, 1::2]))
        out.append((f"{name}.unaligned", new((rint(20, 200),), dtype)[1:]))
    # dense but not contiguous: its bytes travel in memory order when every rank lays it out alike
    out.append(("conv.channels_last", new((rint(2, 9), 5, 3, 3), torch.float32).to(memory_format=torch.channels_last)))
    tied = new((rint(10, 100), 7), torch.float32)
    out.insert(rint(0, len(out)), ("tied.a", tied))
    out.insert(rint(0, len(out)), ("tied.b", tied))
    out.append(("tied.alias", tied.view(-1)))
    return out

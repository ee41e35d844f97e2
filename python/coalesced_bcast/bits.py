"""Tensors as same-size integers: copies and comparisons of these move and compare bits, not values."""
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """The same elements as same-size integers, any strides (complex as pairs of its real parts)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])

"""State shapes shared by the GPU tests and the benchmark (from shared/anchors/baseline_bcast.py)."""
import torch


def llama8b_shapes(layers=32, hidden=4096, inter=14336, kv=1024, vocab=128256):
    """The 291 parameter shapes of Llama-3-8B (14.96 GiB in bf16)."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes += [(hidden,), (vocab, hidden)]
    return shapes


def small_shapes(n=16384, seed=0):
    """n 1-D tensors of 256..65535 elements (about 1 GiB in bf16), as in the anchors."""
    g = torch.Generator().manual_seed(seed)
    return [(int(x),) for x in torch.randint(256, 65536, (n,), generator=g)]

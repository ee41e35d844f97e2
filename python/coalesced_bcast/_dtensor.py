"""DTensor's classes, imported only where some module already did: ``torch.distributed.tensor`` takes ~0.5 s
to import (sympy, its op table), which a process that only syncs with DDP or FSDP1 should not pay for
``import coalesced_bcast``. No object is a DTensor before its class exists, so until then the checks
compare against classes that nothing is an instance of."""
from __future__ import annotations

import sys
from typing import Any


class _NoDTensor:  # nothing is one
    pass


class _NoPlacement:
    pass


_NONE = (_NoDTensor, _NoPlacement, _NoPlacement)
_found: tuple[Any, Any, Any] | None = None


def classes() -> tuple[Any, Any, Any]:
    """(DTensor, Replicate, Shard) where this process has imported them, else stand-ins."""
    global _found
    if _found is not None:
        return _found
    if "torch.distributed.tensor" not in sys.modules and "torch.distributed._tensor" not in sys.modules:
        return _NONE
    try:  # DTensor's home since torch 2.5; torch 2.4 had it in a private module
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
    _found = (DTensor, Replicate, Shard)
    return _found

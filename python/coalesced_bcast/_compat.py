"""The torch this package's C++ extension was built against, checked before the extension loads.

_C links against libtorch's C++ symbols, which change between torch releases: under another torch it
fails to load with an undefined symbol, or loads and misbehaves. The build records torch.__version__
(setup.py writes _build_info.py), and the package refuses, with an ImportError naming both versions,
a torch whose public version (X.Y.Z, without the local "+cu130" tag) differs. The local tag is not
compared: the same release's CUDA and CPU wheels share the C++ API this extension uses.
"""
from __future__ import annotations

from typing import Optional


def public_version(version: str) -> str:
    """'2.14.1+cu130' -> '2.14.1'."""
    return version.split("+", 1)[0]


def check_torch(built: Optional[str], running: str) -> None:
    """Raise ImportError unless `running` (torch.__version__) is the release `built` was built against.

    `built` is None for a source tree that was never built: then importing _C itself says what is wrong.
    """
    if built is None or public_version(built) == public_version(running):
        return
    raise ImportError(
        f"coalesced_bcast was built against torch {built}, but torch {running} is installed: its C++ extension "
        f"only works with the torch release it was built against. Rebuild it under this torch "
        f"(`pip install --no-build-isolation .`, or `bash scripts/setup.sh` in a checkout), or install "
        f"torch=={public_version(built)}.")


def built_torch_version() -> Optional[str]:
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION

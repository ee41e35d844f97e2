"""coalesced_bcast: broadcast a model's parameters and buffers from one rank, with bounded GPU memory.

    import coalesced_bcast
    stats = coalesced_bcast.sync_module(model, src=0)            # every parameter and buffer
    stats = coalesced_bcast.broadcast_tensors(tensors, src=0)    # any list of tensors
    plan = coalesced_bcast.plan_sync(model, src=0); plan.run()   # the same tensors, again and again
    coalesced_bcast.RefitSender(model.named_parameters(), group).send()  # a trainer's weights to engines
"""
import torch as _torch

from ._version import __version__
from . import _compat

# Before anything loads _C: under another torch than the build's, say so (an ImportError naming both).
_compat.check_torch(_compat.built_torch_version(), _torch.__version__)

from .agree import AgreementError, CollectiveError
from .sync import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_COALESCE_BYTES,
    DEFAULT_INPLACE_MIN_BYTES,
    DEFAULT_RING_DEPTH,
    SyncPlan,
    SyncStats,
    broadcast_tensors,
    plan_sync,
    sync_module,
)
from . import fsdp
from .verify import VerifyError, VerifyStats, tensor_hashes, verify_tensors
from .state_dict import DEFAULT_LOAD_BUCKET_BYTES, LoadStateDictError, LoadStats, load_full_state_dict
from .refit import (DEFAULT_REFIT_BUCKET_BYTES, DEFAULT_REFIT_RING_DEPTH, RefitBatch, RefitReceiver, RefitSender,
                    RefitStats, init_refit_group)
from .install import PatchedCall, install, installed, is_installed, patched_calls, uninstall

__all__ = [
    "AgreementError",
    "CollectiveError",
    "VerifyError",
    "VerifyStats",
    "tensor_hashes",
    "verify_tensors",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_COALESCE_BYTES",
    "DEFAULT_INPLACE_MIN_BYTES",
    "DEFAULT_LOAD_BUCKET_BYTES",
    "DEFAULT_RING_DEPTH",
    "SyncPlan",
    "SyncStats",
    "plan_sync",
    "broadcast_tensors",
    "sync_module",
    "fsdp",
    "PatchedCall",
    "install",
    "installed",
    "is_installed",
    "patched_calls",
    "uninstall",
    "LoadStateDictError",
    "LoadStats",
    "load_full_state_dict",
    "DEFAULT_REFIT_BUCKET_BYTES",
    "DEFAULT_REFIT_RING_DEPTH",
    "RefitBatch",
    "RefitReceiver",
    "RefitSender",
    "RefitStats",
    "init_refit_group",
]

"""install() before anything imported FSDP1: it does not import FSDP1 itself (that costs a DDP-only process
about a second), and patches FSDP1's names the moment torch imports them, so that FSDP1's sync_module_states
still goes through coalesced_bcast, bitwise. This module imports nothing of FSDP1 at the top on purpose."""
import inspect
import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks

_FSDP1 = "torch.distributed.fsdp"


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _body(rank, world_size):
    assert _FSDP1 not in sys.modules, "FSDP1 was imported before the test began: it tests nothing here"
    patched = coalesced_bcast.install()
    try:
        assert _FSDP1 not in sys.modules, "install() imported FSDP1"
        assert len(patched) == 7 and coalesced_bcast.is_installed(), patched
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import _init_utils
        from torch.distributed.fsdp._flat_param import FlatParamHandle
        for owner, name in ((_init_utils, "_sync_module_params_and_buffers"), (_init_utils, "_sync_params_and_buffers"),
                            (_init_utils, "_check_module_states_for_sync_module_states"),
                            (_init_utils, "_materialize_with_param_init_fn"), (FlatParamHandle, "flatten_tensors")):
            assert hasattr(getattr(owner, name), "__wrapped__"), f"{name} was not patched when FSDP1 was imported"
        assert coalesced_bcast.install() == patched  # idempotent
        # the module's own loader still answers through the wrapper (inspect, linecache, tracebacks)
        assert "def _sync_module_params_and_buffers" in inspect.getsource(_init_utils)
        coalesced_bcast.patched_calls(clear=True)
        # FSDP1 refuses CPU modules unless the patched check lets a gloo group through: it went through ours.
        model = FSDP(_net(rank), device_id=torch.device("cpu"), sync_module_states=True)
        calls = coalesced_bcast.patched_calls()
        assert calls and all(c.site == "fsdp1" and c.stats is not None for c in calls), calls
        with FSDP.summon_full_params(model, writeback=False):
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        want = torch.cat([p.detach().reshape(-1) for p in _net(0).parameters()])
        assert torch.equal(flat.view(torch.int32), want.view(torch.int32)), f"rank {rank} differs from the source"
    finally:
        coalesced_bcast.uninstall()
    assert not coalesced_bcast.is_installed()
    assert not hasattr(_init_utils._sync_params_and_buffers, "__wrapped__")
    dist.barrier()


def test_install_patches_fsdp1_when_torch_imports_it():
    run_ranks(2, _body)


def test_uninstall_before_fsdp1_is_imported_leaves_it_as_torch_made_it():
    code = textwrap.dedent(f"""
        import sys
        import coalesced_bcast
        coalesced_bcast.install()
        coalesced_bcast.uninstall()
        assert not coalesced_bcast.is_installed()
        from torch.distributed.fsdp import _init_utils
        assert not hasattr(_init_utils._sync_params_and_buffers, "__wrapped__")
        assert type(_init_utils.__loader__).__module__ != "coalesced_bcast.install"
        assert not any(type(f).__module__ == "coalesced_bcast.install" for f in sys.meta_path)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

"""Host cost of walking a module tree: torch's walks against the C++ ones (csrc/module_walk.cpp), and a
one-shot sync_module with each, on bench.py's moe_hf tree (Qwen3-MoE's layout: a module per expert
matrix, 18,769 tensors in 25,108 modules). The walks in Python are what the library ran before: the
load's `_walk_modules` (its Python fallback, `_walk_modules_py`) and sync_module's `module_states` (named_parameters()).
Median and best of 9, two rounds; on GPUs the tensors are on the GPU and the sync is timed to its end.

    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/module_walk.py   (2: the syncs broadcast)
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup  # noqa: E402
from bench import build, moe_hf_state, module_of  # noqa: E402

import coalesced_bcast  # noqa: E402
from coalesced_bcast import _C  # noqa: E402
from coalesced_bcast.state_dict import _walk_modules, _walk_modules_py as py_walk  # noqa: E402
from coalesced_bcast.sync import broadcast_tensors, module_states  # noqa: E402


def main():
    device = dist_setup.init()
    spec = moe_hf_state(layers=48, hidden=512, inter=128, experts=128)
    ts = build(spec, device)
    m = module_of(spec, ts)
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    say(f"moe_hf: {len(ts)} tensors, {sum(1 for _ in m.modules())} modules, torch {torch.__version__}, {device}")
    assert py_walk(m) == _walk_modules(m)

    def old_sync():  # sync_module before: names and tensors from module_states
        names, tensors = module_states(m)
        return broadcast_tensors(tensors, 0, names=lambda: names)

    cases = [("_walk_modules in Python (before)", lambda: py_walk(m)),
             ("_walk_modules (C++ load_walk)", lambda: _walk_modules(m)),
             ("model.state_dict(keep_vars=True)", lambda: m.state_dict(keep_vars=True)),
             ("module_states (named_parameters walk)", lambda: module_states(m)),
             ("_C.module_slots", lambda: _C.module_slots(m, True, False)),
             ("sync_module, walk by module_states", old_sync),
             ("sync_module (C++ walk)", lambda: coalesced_bcast.sync_module(m, 0))]
    for rnd in range(2):
        for name, fn in cases:
            out = []
            for _ in range(9):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                out.append(time.perf_counter() - t)
            say(f"  round {rnd} {name:40s} median {statistics.median(out) * 1e3:7.2f} ms  "
                  f"best {min(out) * 1e3:7.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

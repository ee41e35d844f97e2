"""Host time of load_full_state_dict by phase, for bench/fsdp2_load.py (--phases, --interleave, --trace).

The load is a sequence of named private functions of the package (state_dict.py and the _load_* modules it
is split into); PHASES lists them. Each phase is wrapped, wherever a module of the package holds it by that
name, for as long as a `with` block lasts: a name no module holds is left out, so the bench runs on a tree
whose phases are named otherwise and then reports fewer phases, never wrong ones.
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch

#: The load's phases in the order they run. host_reads_wait: the source waits for its copies of host memory,
#: after FSDP2's post-hooks ran beside them. _prepare: the ring made and the source's first buckets packed.
PHASES = ["_model_device", "_describe_source", "_broadcast_meta", "_plan_local", "_prepare", "_agree", "_transfer",
          "_run_post_hooks", "host_reads_wait"]


def _package_modules() -> list:
    """The package's loaded modules (state_dict and whatever private modules it calls into)."""
    import coalesced_bcast  # noqa: F401  (loads the package and its front-ends)
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "coalesced_bcast" or name.startswith("coalesced_bcast."))]


@contextlib.contextmanager
def _wrapped(names, around):
    """Inside: each function in `names` runs as around(name, call) runs it, in every module that holds it."""
    patched = []
    for module in _package_modules():
        for name in names:
            fn = module.__dict__.get(name)
            if callable(fn):
                patched.append((module, name, fn))

    def wrap(name, fn):
        return lambda *a, **kw: around(name, lambda: fn(*a, **kw))

    for module, name, fn in patched:
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


@contextlib.contextmanager
def phase_ranges():
    """Inside: each phase (and the module walk) runs under a profiler range of its own name, so that a
    torch.profiler trace shows where the host was while the GPU worked."""
    def ranged(name, call):
        with torch.profiler.record_function(name):
            return call()

    with _wrapped(PHASES + ["_walk_modules"], ranged):
        yield


@contextlib.contextmanager
def phase_timers():
    """Inside: the phases wrapped with timers; yields {phase: seconds}, summed over the loads made inside."""
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(name, call):
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            spent[name] += time.perf_counter() - t0

    with _wrapped(PHASES, timed):
        yield spent

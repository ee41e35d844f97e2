"""Run any Python process with coalesced_bcast.install() active: put this folder on PYTHONPATH and set
COALESCED_BCAST_INSTALL=1. Used by run.sh to run torch's own DDP/FSDP tests through the extension.

install() runs right after `import torch` finishes (torch imports torch.distributed and DDP itself), so
processes that never import torch are untouched. Spawned and forked children get it too: spawned ones
start a fresh interpreter that reads this file; forked ones inherit the patched torch.

With COALESCED_BCAST_INSTALL_LOG=PATH, each process that installed appends one JSON line to PATH at exit:
{"pid", "test" (PYTEST_CURRENT_TEST, inherited by spawned ranks), "patched", "served": {site: n},
"fallback": {"site: reason": n}}.
"""
import os
import sys

if os.environ.get("COALESCED_BCAST_INSTALL") == "1":
    import importlib.abc
    import importlib.util

    _done = set()  # pids that wrote their log line

    def _log_calls():
        path = os.environ.get("COALESCED_BCAST_INSTALL_LOG")
        if not path or os.getpid() in _done or "coalesced_bcast" not in sys.modules:
            return
        _done.add(os.getpid())
        import json
        import coalesced_bcast as cb
        served, fallback = {}, {}
        for c in cb.patched_calls():
            if c.stats is not None:
                served[c.site] = served.get(c.site, 0) + 1
            else:
                key = f"{c.site}: {c.fallback}"
                fallback[key] = fallback.get(key, 0) + 1
        line = json.dumps({"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST"),
                           "patched": len(cb.install()), "served": served, "fallback": fallback})
        with open(path, "a") as f:
            f.write(line + "\n")

    def _install():
        try:
            import coalesced_bcast
            coalesced_bcast.install()
        except Exception as e:  # say so, but leave the process running on torch's own functions
            print(f"sitecustomize: coalesced_bcast.install() failed: {e!r}", file=sys.stderr)
            return
        if os.environ.get("COALESCED_BCAST_INSTALL_LOG"):
            import atexit
            import multiprocessing.util as mp_util
            atexit.register(_log_calls)  # normal exits and spawned children
            # multiprocessing's forked children leave by os._exit (no atexit), after running its finalizers
            mp_util.register_after_fork(_log_calls, lambda _: mp_util.Finalize(None, _log_calls, exitpriority=0))
            mp_util.Finalize(None, _log_calls, exitpriority=0)  # spawned children, which also end by _exit_function

    class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Finds `torch` through the other finders and calls _install() once its __init__ has run."""

        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None:
                self._loader, spec.loader = spec.loader, self
            return spec

        def create_module(self, spec):
            return self._loader.create_module(spec)

        def exec_module(self, module):
            module.__loader__ = module.__spec__.loader = self._loader  # torch's own from here on
            self._loader.exec_module(module)
            _install()

    sys.meta_path.insert(0, _AfterTorch())

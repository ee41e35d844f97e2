"""install(): FSDP1's ``sync_module_states`` and DDP's init sync move their bytes through coalesced_bcast.

Patched names (each is looked up by torch at call time in the module named here, which is why
patching ``torch.distributed.utils`` alone would not reach FSDP1, whose ``_init_utils`` imported
``_sync_params_and_buffers`` by name):

- ``torch.distributed.fsdp._init_utils._sync_module_params_and_buffers``: FSDP1's per-unit sync;
  wrapped to lay the unit's parameters out in one buffer first (``fsdp.lay_out_unit``), and to
  restore tied weights the source has and this rank lost, then retry once.
- ``torch.distributed.fsdp._init_utils._sync_params_and_buffers``: its byte mover.
- ``torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states``: its CPU
  refusal; lifted when the unit's group has gloo, kept otherwise (torch's message, then the tensor's name).
- ``torch.distributed.fsdp._init_utils._materialize_with_param_init_fn``: hands a whole unit to
  ``coalesced_bcast.fsdp.param_init_fn`` (one buffer per unit); any other ``param_init_fn`` is called
  as torch calls it.
- ``torch.distributed.fsdp._flat_param.FlatParamHandle.flatten_tensors``: such a buffer becomes the
  unit's FlatParameter without a copy.
- ``torch.nn.parallel.distributed._sync_module_states``: DDP's init (and join) sync.
- ``torch.nn.parallel.distributed._verify_param_shape_across_processes``: DDP's check before it; a rank
  that fails it tells the others' agreement, so that they hand the sync to torch instead of waiting.

The replacements live in _install_sites; this module patches them in and out: where each name is
looked up, the deferred patch of FSDP1's names at its import, install/uninstall and patched_calls.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import logging
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from . import fsdp as _fsdp
from ._install_sites import _FLAT, _FSDP, _REPLACEMENTS, PatchedCall, _history
from ._install_sites import _FsdpUnit, _unit  # noqa: F401  (the unit being synced: tests set it)

logger = logging.getLogger(__name__)

_lock = threading.RLock()  # reentrant: an import made under it (_owner) may be FSDP1's, whose hook takes it too
_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> torch's function, while installed


def _owner(path: str) -> Any:
    """The module, or a class inside one ('pkg.mod.Class'), that holds a patched name."""
    try:
        return importlib.import_module(path)
    except ImportError:
        mod, _, attr = path.rpartition(".")
        owner = getattr(importlib.import_module(mod), attr, None)
        if owner is None:
            raise ImportError(f"{mod} has no {attr}") from None
        return owner


def _wrap(repl: Callable, original: Callable) -> Callable:
    """A fresh function with the original's name and doc, so that tracebacks and help() still read as torch's."""
    @functools.wraps(original)
    def patched(*args, **kwargs):
        return repl(original, *args, **kwargs)
    return patched


def is_installed() -> bool:
    return bool(_originals) or _deferred is not None


# FSDP1's modules, when install() runs before anything imported them: patched the moment torch imports
# _init_utils (which imports _flat_param first), so that a process that never uses FSDP1 does not pay for
# importing it (torch.distributed.fsdp pulls in DTensor, one of torch's slowest imports).
_deferred: Optional["_PatchOnImport"] = None


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch of the names install() deferred."""

    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _patch_deferred()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: inspect and linecache use them
        if name == "_inner":  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds FSDP1's _init_utils as the finders after it would, and wraps its loader."""

    def find_spec(self, fullname: str, path, target=None):
        if fullname != _FSDP:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _fsdp1_site(mod_name: str) -> bool:
    return mod_name == _FSDP or mod_name.startswith(_FLAT)


def _patch(entries: list) -> list[str]:
    """Patch the entries' names (holding _lock); log what this torch lacks. Returns the names patched."""
    patched, missing = [], []
    for mod_name, name, repl, consequence in entries:
        try:
            mod = _owner(mod_name)
        except ImportError as e:
            missing.append(f"{mod_name}.{name} ({consequence}; import failed: {e})")
            continue
        original = getattr(mod, name, None)
        if not callable(original):
            missing.append(f"{mod_name}.{name} ({consequence})")
            continue
        _originals[(mod_name, name)] = original
        setattr(mod, name, _wrap(repl, original))
        patched.append(f"{mod_name}.{name}")
    for m in missing:
        logger.warning("coalesced_bcast.install: torch %s has no %s", torch.__version__, m)
    return patched


def _patch_deferred() -> None:
    with _lock:
        if _deferred is None:
            return
        _drop_finder()
        patched = _patch([e for e in _REPLACEMENTS if _fsdp1_site(e[0])])
        logger.info("coalesced_bcast.install: FSDP1 imported: patched %s", ", ".join(patched) or "nothing")


def _drop_finder() -> None:
    global _deferred
    if _deferred is not None:
        try:
            sys.meta_path.remove(_deferred)
        except ValueError:  # someone else took it out
            pass
        _deferred = None


def install() -> list[str]:
    """Route FSDP1's ``sync_module_states`` and DDP's init sync through coalesced_bcast.

    Idempotent. A name this torch lacks is logged (with the torch version) and skipped; the rest are
    patched. FSDP1's names are patched when torch imports FSDP1, if it has not yet. Returns the dotted
    names patched (FSDP1's included when they wait for that import).
    """
    global _deferred
    with _lock:
        if _originals or _deferred is not None:
            return _names_installed()
        entries = list(_REPLACEMENTS)
        if _FSDP not in sys.modules:
            entries = [e for e in entries if not _fsdp1_site(e[0])]
            _deferred = _PatchOnImport()
            sys.meta_path.insert(0, _deferred)
        patched = _patch(entries)
        logger.info("coalesced_bcast.install: torch %s: patched %s%s", torch.__version__,
                    ", ".join(patched) or "nothing", "; FSDP1's names once torch imports it" if _deferred else "")
        return _names_installed()


def _names_installed() -> list[str]:
    """Patched names, and FSDP1's while they wait for its import, in _REPLACEMENTS' order."""
    return [f"{m}.{n}" for m, n, _, _ in _REPLACEMENTS
            if (m, n) in _originals or (_deferred is not None and _fsdp1_site(m))]


def uninstall() -> None:
    """Put torch's own functions back (a no-op when not installed)."""
    with _lock:
        _drop_finder()
        for (mod_name, name), original in _originals.items():
            mod = _owner(mod_name)
            current = getattr(mod, name, None)
            if getattr(current, "__wrapped__", None) is not original:
                logger.warning("coalesced_bcast.uninstall: %s.%s was replaced by someone else after install(); "
                               "restoring torch's own anyway", mod_name, name)
            setattr(mod, name, original)
        if _originals:
            logger.info("coalesced_bcast.uninstall: restored %d torch functions", len(_originals))
        _originals.clear()
        _fsdp._arenas.clear()


@contextlib.contextmanager
def installed() -> Iterator[list[str]]:
    """``install()`` for the duration of a ``with`` block; leaves an earlier ``install()`` in place."""
    was = is_installed()
    patched = install()
    try:
        yield patched
    finally:
        if not was:
            uninstall()


def patched_calls(clear: bool = False) -> list[PatchedCall]:
    """The syncs (most recent 4096) that went through the patched functions in this process."""
    out = list(_history)
    if clear:
        _history.clear()
    return out

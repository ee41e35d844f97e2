"""Run a function on N ranks over gloo, with a FileStore (no ports) or a TCPStore on a free port, and a
hard timeout."""
from __future__ import annotations

import faulthandler
import gc
import os
import tempfile
import time
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120


def _tcp_store(rank: int, world_size: int, files: dist.FileStore) -> dist.TCPStore:
    """A TCPStore on a port the OS picks (port 0), its number handed out through the FileStore."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        files.set("tcp_port", str(store.port))
        return store
    return dist.TCPStore("127.0.0.1", int(files.get("tcp_port")), world_size, is_master=False)


def _entry(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, backend: str,
           store_kind: str, dump_after: float) -> None:
    faulthandler.enable()  # a crash in native code still names the Python frame it came from
    # A rank still running shortly before run_ranks kills it prints every thread's Python stack: a hang
    # in CI then says where it waited.
    faulthandler.dump_traceback_later(dump_after, exit=False)
    store = dist.FileStore(store_path, world_size)
    if store_kind == "tcp":
        store = _tcp_store(rank, world_size, store)
    if backend == "nccl":
        import torch
        torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        # Exceptions kept by pytest.raises hold the group alive past destroy_process_group, and
        # it would then die during interpreter exit ("terminate called without an active exception").
        gc.collect()
        # torch 2.4's ProcessGroupGloo destructor waits for its worker threads holding the GIL, and a worker
        # that drops the last reference to a Python-made tensor of a finished collective (the test's
        # all_gather outputs) needs the GIL for it: a deadlock (seen in kept-plan tests; gdb:
        # ~ProcessGroupGloo against ~AsyncAllgatherWork -> THPVariable_clear). A moment without the GIL
        # lets the workers finish first.
        time.sleep(0.05)
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S,
              backend: str = "gloo", store: str = "file") -> None:
    """Spawn `world_size` processes running fn(rank, world_size, *args); re-raise the first failure.

    fn must be a module-level function (it is pickled). A run past `timeout` seconds is killed and fails.
    `store`: "file" (FileStore: no queues) or "tcp" (TCPStore, what torchrun gives: queues).
    """
    with tempfile.TemporaryDirectory() as d:
        dump_after = max(1.0, timeout - min(10.0, timeout / 4))
        ctx = mp.start_processes(_entry, args=(world_size, os.path.join(d, "store"), fn, args, backend, store,
                                               dump_after),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout} s")

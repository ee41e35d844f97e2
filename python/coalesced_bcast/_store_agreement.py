"""An agreement's rounds through the group's c10d store (agree.Agreement picks it for groups of up to
STORE_MAX_RANKS ranks). Every rank numbers rounds with a per-group counter (it calls collectives in the
same order). Nothing is left to delete when all is well: the record and, with two ranks, the verdict
live in one of two slots (round number mod 2) that the round after next reuses, once every rank has
left this one.

1. Each rank publishes its record unless another rank did first: one compare-and-set against what the
   slot held two rounds ago (every rank saw that), which returns the first rank's record, and compares
   its own header (status, digest, count) with it.
2. The verdict: with two ranks, the second to arrive knows it and pushes it onto the slot's queue (one
   message, not a round trip: on FSDP1 the second is often the rank that materialized the unit), and the
   first pops it, which empties the queue for the next use. With more ranks, or a store without queues
   (FileStore), every rank adds 1 to a counter of this round (plus a flag for a difference or a
   refusal), the last sets the total under this round's key and the others wait for it; the first to
   arrive removes the keys of the round before last.
3. Only on a difference or a refusal does every rank learn every rank's record: with two ranks the
   verdict message is the second's record, with more every rank publishes its own under a key.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ._collectives import CollectiveError, _deadline, process_rank

_REFUSED = 1
# A rank's flag, added to the arrival count: its record differs from the first one or it refused.
_BAD = 1 << 20
#: Seconds and calls per store operation (compare_set, set, wait, ...) of every agreement in this process,
#: for benchmarks: how much of the agreement is the store's round trips.
store_op_seconds: dict[str, float] = {}
store_op_counts: dict[str, int] = {}


@dataclass
class _GroupState:
    """What this rank keeps between the agreements of one group."""

    prefix: str  # this group's keys in its store
    queues: bool  # the verdict goes through a queue: two ranks, a store with queues (TCPStore; not FileStore)
    seq: int = 0  # agreements so far: every rank numbers them alike
    slots: list = field(default_factory=lambda: ["", ""])  # the record each slot holds now
    own_keys: list = field(default_factory=list)  # (seq, key): keys this rank wrote, removed at seq + 2


_groups: "weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState]" = weakref.WeakKeyDictionary()


def _group_state(pg: dist.ProcessGroup, store, op) -> _GroupState:
    """`op(fn, *args)` runs a store operation (the agreement's `_op`)."""
    state = _groups.get(pg)
    if state is None:
        # A store can outlive its group (destroy_process_group, then init_process_group on torchrun's
        # agent store): the keys of an earlier group of the same name would read as this one's. Every
        # rank adds 1 once, at the group's first agreement, so (count - 1) // size numbers this group's
        # incarnation alike on every rank. (A round trip per group, once.)
        epoch = (int(op(store.add, "coalesced_bcast/agree/groups", 1)) - 1) // pg.size()
        queues = False
        if pg.size() == 2:  # only a two-rank verdict goes through a queue
            try:
                op(store.queue_len, "coalesced_bcast/agree/queues")
                queues = True
            except (NotImplementedError, RuntimeError, AttributeError):  # FileStore; a torch before queues
                pass
        state = _groups[pg] = _GroupState(f"coalesced_bcast/agree/{epoch}/", queues)
    return state


def _file_backed(store) -> bool:
    """Whether `store`, under any PrefixStores, is a FileStore."""
    while isinstance(store, dist.PrefixStore):
        store = getattr(store, "underlying_store", None)
    return isinstance(store, dist.FileStore)


class _StoreThread:
    """A daemon thread that runs a FileStore's operations while the caller waits with a deadline.

    Why: a process killed while it writes to a FileStore leaves a torn record at the end of the file,
    and torch's FileStore then never returns from any operation: its read loop makes no progress at the
    end of the file (0 bytes read) and spins, holding the store's mutex. Waiting on this thread, the
    caller raises at its deadline instead; the thread is abandoned to its spin (the group is unusable
    then anyway), and the operation's bound method keeps the store alive: FileStore's destructor would
    wait for that mutex, and the process could not exit."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="coalesced_bcast-filestore", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self.jobs.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            del fn, args, box
            done.set()

    def call(self, fn, args: tuple, seconds: float):
        """fn(*args), or raise TimeoutError once `seconds` pass without it returning."""
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, args, box, done))
        if not done.wait(seconds):
            raise TimeoutError(f"the group's FileStore did not answer within {seconds:.1f} s (a rank killed while "
                               f"it wrote to the store leaves a torn record that torch's FileStore never reads past)")
        ok, value = box[0]
        if ok:
            return value
        raise value


# Idle store threads. A caller takes one for its operation (or starts one), so that callers on other
# threads (syncs on other groups) never queue behind a long store wait; a thread whose operation did not
# return is not put back.
_idle_store_threads: list[_StoreThread] = []
_idle_lock = threading.Lock()


def _forget_store_threads() -> None:  # a forked child has the objects, not the threads
    global _idle_lock
    _idle_lock = threading.Lock()
    _idle_store_threads.clear()


os.register_at_fork(after_in_child=_forget_store_threads)


def _bounded_store_call(fn, args: tuple, seconds: float):
    """fn(*args) on an idle store thread, or TimeoutError after `seconds`."""
    with _idle_lock:
        worker = _idle_store_threads.pop() if _idle_store_threads else None
    if worker is None:
        worker = _StoreThread()
    try:
        return worker.call(fn, args, seconds)
    except TimeoutError:
        worker = None  # still inside fn: abandoned
        raise
    finally:
        if worker is not None:
            with _idle_lock:
                _idle_store_threads.append(worker)


def _group_store(pg: dist.ProcessGroup):
    try:
        return dist.distributed_c10d._get_process_group_store(pg)
    except (AttributeError, KeyError, RuntimeError):  # a torch without it, or a group made without a store
        return None


def _split(value: str) -> tuple[int, str, str]:
    """A published record "seq#rank#status digest count#message": (rank, header, message)."""
    _, rank, header, message = value.split("#", 3)
    return int(rank), header, message


class StoreRounds:
    """One agreement's rounds, exchanges and shares through the group's store, under one deadline."""

    def __init__(self, store, pg: dist.ProcessGroup, timeout: Optional[timedelta]):
        self.store, self.pg, self.timeout = store, pg, timeout
        self.limit = _deadline(pg, timeout).total_seconds()
        self.t0 = time.monotonic()
        self.rank = process_rank(pg)
        self.waited = 0.0  # seconds blocked until other ranks had written what this one needed
        self.bounded = _file_backed(store)  # its operations run on _StoreThread, against the deadline
        self.group = _group_state(pg, store, self._op)
        self.seq = -1
        self.parts = 0  # exchanges and shares in this round, each under keys of its own

    def _key(self, name: str, seq: Optional[int] = None) -> str:
        return f"{self.group.prefix}{self.seq if seq is None else seq}/{name}"

    def _slot_key(self, name: str) -> str:
        return f"{self.group.prefix}slot{self.seq % 2}/{name}"

    def _op(self, fn, *args):
        t = time.perf_counter()
        try:
            if self.bounded:
                # 1 s past the deadline: a store wait that honours it raises its own error first
                left = self.limit - (time.monotonic() - self.t0)
                return _bounded_store_call(fn, args, max(left, 0.0) + 1.0)
            return fn(*args)
        except (RuntimeError, TimeoutError) as e:  # a deadline passed, the store went away with its host
            limit = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the group's timeout"
            raise CollectiveError(
                f"coalesced_bcast: the agreement over {self.pg.size()} ranks failed on rank {self.rank} after "
                f"{time.monotonic() - self.t0:.1f} s (limit: {limit}): a rank died, did not call the sync in time, "
                f"or called another collective. The group is unusable now. Cause: {e}") from e
        finally:
            name = getattr(fn, "__name__", "op")
            store_op_seconds[name] = store_op_seconds.get(name, 0.0) + time.perf_counter() - t
            store_op_counts[name] = store_op_counts.get(name, 0) + 1

    def _expired(self):
        raise RuntimeError(f"the deadline of {self.limit:g} s passed")

    def wait_keys(self, keys: list[str]) -> None:
        t = time.monotonic()
        left = self.limit - (t - self.t0)
        if left <= 0:
            self._op(self._expired)
        self._op(self.store.wait, keys, timedelta(seconds=left))
        self.waited += time.monotonic() - t

    def raw(self, name: str) -> bytes:
        """The value of `name` once some rank has set it, waiting no longer than the deadline."""
        self.wait_keys([self._key(name)])
        return self._op(self.store.get, self._key(name))

    def get(self, name: str) -> str:
        return self.raw(name).decode(errors="replace")

    def set(self, name: str, value: str | bytes, own: bool = False) -> None:
        """own: this rank removes the key two rounds on (keys every rank writes in rounds off the fast path)."""
        self._op(self.store.set, self._key(name), value)
        if own:
            self.group.own_keys.append((self.seq, self._key(name)))

    def add(self, name: str, n: int) -> int:
        return int(self._op(self.store.add, self._key(name), n))

    def clean_up(self, n: int) -> None:
        """Keys of the round before the previous one, where verdicts go through keys (more than two ranks, or
        a store without queues): every rank has left it, as every rank has arrived at the previous one."""
        if self.seq >= 2:
            for k in ("done",) + (("arrived",) if n != 2 else ()):
                self._op(self.store.delete_key, self._key(k, self.seq - 2))

    def publish(self, record: str) -> str:
        """Set this round's record in its slot unless a rank did first; the record there now.

        The slot holds the record of the round before last, which every rank saw: the first rank's
        compare-and-set against it succeeds, the others' return the first's record."""
        slots = self.group.slots
        cur = self._op(self.store.compare_set, self._slot_key("ref"), slots[self.seq % 2], record)
        cur = cur.decode(errors="replace")
        if not cur.startswith(f"{self.seq}#"):
            raise CollectiveError(
                f"coalesced_bcast: rank {self.rank} found {cur[:80]!r} where agreement {self.seq} of its group "
                f"keeps its record in the group's store: the ranks have called a different number of syncs on "
                f"this group, or something else writes coalesced_bcast's keys")
        slots[self.seq % 2] = cur
        return cur

    def _next_round(self) -> None:
        self.seq = self.group.seq
        self.group.seq += 1
        self.parts = 0
        mine = self.group.own_keys
        while mine and mine[0][0] <= self.seq - 2:
            self._op(self.store.delete_key, mine.pop(0)[1])

    def verdict(self, status: int, digest: int, count: int, message: str) -> Optional[list[tuple[int, str, str]]]:
        """One round: None when every rank's header equals this one's and none refused; else every rank's
        (rank, "status digest count", message), in group rank order."""
        self._next_round()
        n, me = self.pg.size(), self.pg.rank()
        header = f"{status} {digest} {count}"
        record = f"{self.seq}#{me}#{header}#{message}"
        cur = self.publish(record)
        first = cur == record
        bad = status == _REFUSED or _split(cur)[1] != header
        if self.group.queues:
            if first:
                key = self._slot_key("verdict")  # popping it leaves the queue empty for the round after next
                self.wait_keys([key])
                other = self._op(self.store.queue_pop, key, False).decode(errors="replace")
                return None if other == "0" else sorted([_split(record), _split(other)])
            self._op(self.store.queue_push, self._slot_key("verdict"), record if bad else "0")
            return sorted([_split(cur), _split(record)]) if bad else None
        if n == 2:
            if not first:
                self.set("done", record if bad else "0")
                return sorted([_split(cur), _split(record)]) if bad else None
            self.clean_up(n)
            other = self.get("done")
            return None if other == "0" else sorted([_split(record), _split(other)])
        verdict = None
        total = self.add("arrived", 1 + bad * _BAD)
        if total % _BAD == n:
            verdict = total // _BAD
            self.set("done", str(verdict))
        if first:  # it waits for the others anyway (unless it is alone)
            self.clean_up(n)
        if verdict is None:
            verdict = int(self.get("done"))
        return self.exchange(record.encode(), decode=True) if verdict else None

    def exchange(self, data: bytes, decode: bool = False) -> list:
        """Every rank's `data`, in group rank order (this rank's own as given)."""
        n, me = self.pg.size(), self.pg.rank()
        part = f"x{self.parts}"
        self.parts += 1
        self.set(f"{part}/{me}", data, own=True)
        keys = [self._key(f"{part}/{r}") for r in range(n)]
        self.wait_keys(keys)
        out = [data if r == me else self._op(self.store.get, keys[r]) for r in range(n)]
        return [_split(v.decode(errors="replace")) for v in out] if decode else out

    def share(self, blob: Optional[bytes], src: int) -> bytes:
        """Group rank `src`'s `blob` on every rank."""
        part = f"s{self.parts}"
        self.parts += 1
        if self.pg.rank() == src:
            self.set(part, blob, own=True)
            return blob
        return self.raw(part)

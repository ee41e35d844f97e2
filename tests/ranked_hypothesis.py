"""Hypothesis over the ranks of one process group: rank 0 draws each example and sends it to the others
(broadcast_object_list); every rank runs it and the verdict is their minimum (all_reduce MIN), so that
hypothesis on rank 0 sees a failure on any rank and can shrink it. A final message tells the others to stop,
and whether rank 0 failed.

CI draws the same examples every run (derandomized). A longer hunt draws others: COALESCED_BCAST_TEST_SEED=N
seeds the draw with N, and COALESCED_BCAST_TEST_EXAMPLES=X runs X times each test's count of examples:

    COALESCED_BCAST_TEST_SEED=7 COALESCED_BCAST_TEST_EXAMPLES=5 pytest tests -k hypothesis
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, seed, settings


class _Stop:
    """Rank 0's last message: no more examples, and the failure that ended them ("" if none)."""

    def __init__(self, failure: str):
        self.failure = failure


def examples_on_ranks(rank: int, strategy: Any, run: Callable[[Any], bool], examples: int, out_dir: str,
                      explicit: Iterable[Any] = ()) -> None:
    """run(spec) on every rank for `examples` specs drawn from `strategy` (derandomized; `explicit` ones too);
    rank 0 raises on the first spec that some rank fails, and writes the count it ran to out_dir/count."""
    def verdict(spec) -> bool:
        try:
            ok = run(spec)
        except BaseException:
            # A rank that raises takes its group down before hypothesis can shrink or report: say what it ran.
            print(f"rank {rank} raised on this example: {spec!r}", flush=True)
            raise
        v = torch.tensor([int(ok)])
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return v.item() == 1

    if rank != 0:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], _Stop):
                if box[0].failure:
                    # rank 0 raises the failing example at once; torch's spawn reports the first rank that
                    # fails, so this one waits a moment to let that be rank 0's, which names the example.
                    time.sleep(2.0)
                    raise AssertionError(f"rank 0 found a failing example: {box[0].failure[:2000]}")
                return
            verdict(box[0])
    count = [0]
    hunt_seed = os.environ.get("COALESCED_BCAST_TEST_SEED")
    examples = max(examples, round(examples * float(os.environ.get("COALESCED_BCAST_TEST_EXAMPLES", "1"))))

    def check(spec):
        count[0] += 1
        dist.broadcast_object_list([spec], src=0)
        assert verdict(spec), f"failed on some rank: {spec}"

    check = given(spec=strategy)(check)
    for spec in explicit:
        check = example(spec=spec)(check)
    check = settings(max_examples=examples, deadline=None, database=None, derandomize=hunt_seed is None,
                     suppress_health_check=list(HealthCheck))(check)
    if hunt_seed is not None:
        check = seed(int(hunt_seed))(check)
    try:
        check()
    except BaseException as e:
        dist.broadcast_object_list([_Stop(str(e) or type(e).__name__)], src=0)
        raise
    dist.broadcast_object_list([_Stop("")], src=0)
    with open(os.path.join(out_dir, "count"), "w") as f:
        f.write(str(count[0]))

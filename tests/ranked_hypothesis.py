"""Hypothesis over the ranks of one process group: rank 0 draws each example and sends it to the others
(broadcast_object_list); every rank runs it and the verdict is their minimum (all_reduce MIN), so that
hypothesis on rank 0 sees a failure on any rank and can shrink it. A final None tells the others to stop."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings


def examples_on_ranks(rank: int, strategy: Any, run: Callable[[Any], bool], examples: int, out_dir: str,
                      explicit: Iterable[Any] = ()) -> None:
    """run(spec) on every rank for `examples` specs drawn from `strategy` (derandomized; `explicit` ones too);
    rank 0 raises on the first spec that some rank fails, and writes the count it ran to out_dir/count."""
    def verdict(spec) -> bool:
        v = torch.tensor([int(run(spec))])
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        return v.item() == 1

    if rank != 0:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            verdict(box[0])
    count = [0]

    def check(spec):
        count[0] += 1
        dist.broadcast_object_list([spec], src=0)
        assert verdict(spec), f"failed on some rank: {spec}"

    check = given(spec=strategy)(check)
    for spec in explicit:
        check = example(spec=spec)(check)
    check = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))(check)
    try:
        check()
    finally:
        dist.broadcast_object_list([None], src=0)
    with open(os.path.join(out_dir, "count"), "w") as f:
        f.write(str(count[0]))

"""The process group of a benchmark run under torchrun: NCCL with one GPU per rank where there are
enough GPUs (and the CPU was not asked for), else gloo on the CPU."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def init(cpu: bool = False, timeout: Optional[timedelta] = None) -> torch.device:
    """Initializes the default group and returns this rank's device."""
    kw = {} if timeout is None else {"timeout": timeout}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not cpu and torch.cuda.is_available() and torch.cuda.device_count() >= world:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kw)
    return device

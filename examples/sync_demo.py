"""Main job: sync a sample model from rank 0 with coalesced_bcast and with torch's
_broadcast_coalesced, and check both bitwise against the source: gloo on CPU, NCCL when every rank
has a GPU. scripts/demo.sh runs it; by hand:

    torchrun --nproc-per-node 2 examples/sync_demo.py
"""
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import coalesced_bcast

log = logging.getLogger("sync_demo")


class Sample(nn.Module):
    """A small transformer-ish model: several dtypes, buffers (one non-persistent), tied embeddings."""

    def __init__(self, vocab=5000, hidden=256, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, batch_first=True)
                                    for _ in range(layers))
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.rand(hidden // 2, dtype=torch.float64), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))


def states_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    sa.update(a.named_buffers()); sb.update(b.named_buffers())
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k].detach().cpu().view(-1).view(torch.uint8), sb[k].detach().cpu().view(-1).view(torch.uint8))
        for k in sa)


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    if use_cuda:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    rank = dist.get_rank()
    torch.manual_seed(1234)  # the source's values: every rank can rebuild them to check
    reference = Sample().to(device)
    torch.manual_seed(1000 + rank)  # every rank starts different
    ours, theirs = Sample().to(device), Sample().to(device)
    if rank == 0:
        ours.load_state_dict(reference.state_dict()); theirs.load_state_dict(reference.state_dict())
        ours.inv_freq.copy_(reference.inv_freq); theirs.inv_freq.copy_(reference.inv_freq)

    dist.barrier()
    stats = coalesced_bcast.sync_module(ours, src=0)
    t0 = time.perf_counter()
    tensors = [t.detach() for t in list(theirs.parameters()) + list(theirs.buffers())]
    dist._broadcast_coalesced(dist.group.WORLD, tensors, 250 * 2**20, 0)
    if use_cuda:
        torch.cuda.synchronize()
    baseline_s = time.perf_counter() - t0

    ok_ours, ok_theirs = states_equal(ours, reference), states_equal(theirs, reference)
    tied = ours.head.weight is ours.embed.weight
    result = torch.tensor([int(ok_ours and tied), int(ok_theirs)])
    result = result.to(device)
    dist.all_reduce(result, op=dist.ReduceOp.MIN)  # every rank's verdict
    result = result.cpu()
    if rank == 0:
        log.info("backend %s, %d ranks, torch %s", dist.get_backend(), dist.get_world_size(), torch.__version__)
        log.info("%-28s %8s %10s %8s", "method", "tensors", "seconds", "bitwise")
        log.info("%-28s %8d %10.4f %8s", "coalesced_bcast.sync_module", stats.tensors, stats.seconds,
                 "ok" if result[0] else "WRONG")
        log.info("%-28s %8d %10.4f %8s", "dist._broadcast_coalesced", len(tensors), baseline_s,
                 "ok" if result[1] else "WRONG")
        log.info("stats: %s", stats)
    dist.destroy_process_group()
    if not bool(result[0]):
        raise SystemExit("coalesced_bcast result differs from the source")


if __name__ == "__main__":
    main()

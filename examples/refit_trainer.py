"""The trainer side of a weight refit: an FSDP2 model over this torchrun's ranks streams its weights, cast to
bf16, to an engine process (examples/refit_engine.py) after every step, through a group of its own.

    torchrun --nproc-per-node 2 examples/refit_trainer.py --port 29601 &   # GPUs 0 and 1 (gloo: --cpu)
    python examples/refit_engine.py --port 29601 --device cuda:1           # the engine, beside trainer rank 1

Trainer rank 0 opens the refit group's store at --host:--port; the engine joins it as rank 1. The other
trainer ranks take part in every refit through the trainer group (their shards are gathered to rank 0).
"""
import argparse
import gc
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import coalesced_bcast

H, KV, FF, VOCAB, LAYERS = 256, 64, 512, 1000, 4


class Block(nn.Module):
    """A decoder block in the Hugging Face layout: separate q/k/v and gate/up projections."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        for name, rows, cols in (("q_proj", H, H), ("k_proj", KV, H), ("v_proj", KV, H), ("o_proj", H, H)):
            self.self_attn.add_module(name, nn.Linear(cols, rows, bias=False))
        self.mlp = nn.Module()
        for name, rows, cols in (("gate_proj", FF, H), ("up_proj", FF, H), ("down_proj", H, FF)):
            self.mlp.add_module(name, nn.Linear(cols, rows, bias=False))
        self.input_layernorm = nn.LayerNorm(H, bias=False)

    def forward(self, h):
        a = self.input_layernorm(h)
        q, k, v = self.self_attn.q_proj(a), self.self_attn.k_proj(a), self.self_attn.v_proj(a)
        att = torch.softmax(q[..., :KV] @ k.transpose(-1, -2) / KV**0.5, -1) @ v
        h = h + self.self_attn.o_proj(torch.cat([att] * (H // KV), -1))
        return h + self.mlp.down_proj(torch.relu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Trainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, H)
        self.model.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, x):
        h = self.model.embed_tokens(x)
        for block in self.model.layers:
            h = block(h)
        return self.lm_head(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=29601)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    rank = int(os.environ["RANK"])
    device = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if a.cpu else "nccl")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Trainer().to(device)  # fp32 master weights
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # The refit group: trainer rank 0 and the engine, met at a store of their own.
    refit = coalesced_bcast.init_refit_group(a.host, a.port, 0, 2, device=device) if rank == 0 else None
    sender = coalesced_bcast.RefitSender(model, refit, dtype=torch.bfloat16)
    for step in range(a.steps):
        x = torch.randint(0, VOCAB, (4, 32), device=device)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sender.send(verify=step == a.steps - 1)  # the engine now holds this step's weights, in bf16
        if rank == 0:
            logging.info("step %d: loss %.4f, refit of %d tensors (%.1f MiB) in %.1f ms", step, loss.item(),
                         stats.tensors, stats.bytes / 2**20, stats.seconds * 1e3)
    # Quiet groups before tearing them down: gloo's worker threads release a finished collective's
    # tensors under the GIL, and a group torn down (or dropped) while one still does can deadlock or
    # abort the process ("terminate called without an active exception"). Then free what holds the
    # groups (FSDP's modules keep reference cycles), so that none is destroyed during interpreter exit.
    if refit is not None:
        refit.barrier().wait()
    dist.barrier()
    del sender, opt, model, refit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

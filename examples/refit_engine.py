"""The engine side of a weight refit (see examples/refit_trainer.py): a module whose parameters are fused
the way vLLM fuses them (qkv_proj, gate_up_proj), loaded through its own load_weights from each bucket.

    python examples/refit_engine.py --port 29601 --device cuda:1   # or --device cpu
"""
import argparse
import gc
import logging

import torch
import torch.nn as nn

import coalesced_bcast

H, KV, FF, VOCAB, LAYERS = 256, 64, 512, 1000, 4
# The trainer's (Hugging Face) projection -> (fused parameter, first row in it)
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", H), "v_proj": ("qkv_proj", H + KV),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", FF)}


class EngineBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Parameter(torch.empty(H + 2 * KV, H, dtype=torch.bfloat16), requires_grad=False)
        self.o_proj = nn.Parameter(torch.empty(H, H, dtype=torch.bfloat16), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * FF, H, dtype=torch.bfloat16), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(H, FF, dtype=torch.bfloat16), requires_grad=False)
        self.input_layernorm = nn.Parameter(torch.empty(H, dtype=torch.bfloat16), requires_grad=False)


class Engine(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Parameter(torch.empty(VOCAB, H, dtype=torch.bfloat16), requires_grad=False)
        self.layers = nn.ModuleList(EngineBlock() for _ in range(LAYERS))
        self.lm_head = nn.Parameter(torch.empty(VOCAB, H, dtype=torch.bfloat16), requires_grad=False)

    def target(self, name: str):
        """The trainer's name -> (this engine's tensor, first row): the name mapping of a vLLM model."""
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers":
            block, proj = self.layers[int(parts[1])], parts[-1]
            if proj in STACKED:
                fused, row = STACKED[proj]
                return getattr(block, fused), row
            return getattr(block, proj), 0
        return getattr(self, parts[0]), 0

    @torch.no_grad()
    def load_weights(self, batch: coalesced_bcast.RefitBatch) -> None:
        for name, w in batch:  # views into the ring slot, valid during this call: copy them
            dst, row = self.target(name)
            dst[row:row + w.shape[0]].copy_(w)
        for name, flat, first, _ in batch.pieces:  # a tensor larger than a bucket, piece by piece
            dst, row = self.target(name)
            dst.view(-1)[row * dst.shape[-1] + first:][:flat.numel()].copy_(flat)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=29601)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda:1" if torch.cuda.device_count() > 1 else "cpu")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = Engine().to(device)
    refit = coalesced_bcast.init_refit_group(a.host, a.port, 1, 2, device=device)
    receiver = coalesced_bcast.RefitReceiver(refit, on_weights=engine.load_weights)
    for step in range(a.steps):
        stats = receiver.receive()
        logging.info("step %d: %d tensors in %d buckets, %.1f ms%s", step, stats.tensors, stats.buckets,
                     stats.seconds * 1e3, ", verified" if stats.verified else "")
    refit.barrier().wait()  # quiet, then drop the group now, not during interpreter exit (see refit_trainer.py)
    del receiver, refit
    gc.collect()


if __name__ == "__main__":
    main()

"""accelerate's FSDP1 path with coalesced_bcast.install() active, on 2 GPUs (issue: a true drop-in).

    torchrun --standalone --nproc-per-node 2 bench/accelerate_fsdp1.py --mode install|torch [--out FILE]

What a user of accelerate + transformers runs: FullyShardedDataParallelPlugin(sync_module_states=True,
cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap"), a Llama with tied embeddings
whose weights only rank 0 holds (the others build it on the meta device, as cpu_ram_efficient_loading
has them do), then Accelerator.prepare(). accelerate wraps its param_init_fn in ensure_weights_retied.
Checked on every rank: every full parameter (FSDP.summon_full_params) bitwise equal to rank 0's
weights before the wrap, the tie kept, and with install() which syncs coalesced_bcast served and which
it handed back to torch. --mode torch runs the same without install(): the outcomes must agree.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("install", "torch"), required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # FSDP1 takes a meta module's compute device from the current one and refuses it where it is not
    # accelerate's device_id (rank 1: cuda:0 against cuda:1), with or without install().
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import coalesced_bcast
    if args.mode == "install":
        coalesced_bcast.install()
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaConfig, LlamaForCausalLM

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], sync_module_states=True,
        cpu_ram_efficient_loading=True, use_orig_params=True)
    accelerator = Accelerator(fsdp_plugin=plugin)
    rank = accelerator.process_index
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    if rank == 0:
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # NaN payloads and -0.0 too: random bits in every float tensor
            g = torch.Generator().manual_seed(1)
            for t in model.state_dict().values():
                if t.dtype == torch.float32:
                    bits = torch.randint(-2**31, 2**31 - 1, t.shape, generator=g, dtype=torch.int64)
                    t.view(torch.int32).copy_(bits.to(torch.int32))
        want = {n: t.detach().clone() for n, t in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        want = None
    box = [want]
    dist.broadcast_object_list(box, 0)
    want = box[0]
    model = accelerator.prepare(model)
    with FSDP.summon_full_params(model, writeback=False):
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        got = {n.replace("_fsdp_wrapped_module.", ""): t.detach().cpu() for n, t in named}
        inner = model.module if hasattr(model, "module") else model
        tied = inner.lm_head.weight is inner.model.embed_tokens.weight
    wrong = [n for n in want if n not in got or not torch.equal(got[n].view(-1).view(torch.uint8),
                                                                  want[n].view(-1).view(torch.uint8))]
    served, fallback = {}, {}
    if args.mode == "install":
        for c in coalesced_bcast.patched_calls():
            if c.stats is not None:
                served[c.site] = served.get(c.site, 0) + 1
            else:
                fallback[f"{c.site}: {c.fallback}"] = fallback.get(f"{c.site}: {c.fallback}", 0) + 1
    row = dict(mode=args.mode, rank=rank, tensors=len(want), wrong=len(wrong), first_wrong=wrong[:5], tied=tied,
               served=served, fallback=fallback, torch=torch.__version__,
               accelerate=__import__("accelerate").__version__, transformers=__import__("transformers").__version__)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    ok = all(r["wrong"] == 0 for r in rows)
    accelerator.end_training() if hasattr(accelerator, "end_training") else dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()

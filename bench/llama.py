"""The Llama-3-8B-shaped model of shared/anchors/baseline_bcast.py, shared by the GPU benchmarks
(dimensions are arguments so CPU smoke tests can shrink it)."""
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, hidden=4096, inter=14336, kv=1024):
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv, bias=False)
        self.v = nn.Linear(hidden, kv, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.n1 = nn.LayerNorm(hidden)
        self.n2 = nn.LayerNorm(hidden)


class Model(nn.Module):
    def __init__(self, layers=32, hidden=4096, inter=14336, kv=1024, vocab=128256):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Block(hidden, inter, kv) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab, bias=False)


class Expert(nn.Module):
    def __init__(self, hidden=2048, inter=1408):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)


class MoEBlock(nn.Module):
    """A Mixture-of-Experts decoder block in the Hugging Face layout: every expert's matrices are
    separate tensors (103 per block at the defaults)."""

    def __init__(self, hidden=2048, inter=1408, experts=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, inter) for _ in range(experts)])
        self.n1 = nn.LayerNorm(hidden, bias=False)
        self.n2 = nn.LayerNorm(hidden, bias=False)


class MoEModel(nn.Module):
    """16 blocks of 32 experts (hidden 2048, expert MLP 1408) and a 32k vocabulary: 1,651 tensors,
    about 9 GiB in bf16."""

    def __init__(self, layers=16, hidden=2048, inter=1408, experts=32, vocab=32000):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([MoEBlock(hidden, inter, experts) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

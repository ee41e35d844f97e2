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

"""Bad model file for tests/test_expert_parallel.py: a mixture of experts written as transformers 4's
Mixtral wrote it, the experts an nn.ModuleList called from the block's own loop over the tokens each
expert got (data-dependent shapes), which `--strategy ep=N` refuses in one line."""

import torch
from torch import nn
from torch.nn import functional as F


class Expert(nn.Module):
    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, dim=8, experts=4, top_k=2):
        super().__init__()
        self.gate, self.top_k = nn.Linear(dim, experts, bias=False), top_k
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return self.head(out)


def model():
    return MoE()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

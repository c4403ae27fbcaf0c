"""A Megatron pair (Linear column-wise -> GELU -> Linear row-wise) whose hidden activation is scaled by
a learned gain that tensor parallelism keeps whole: each tp rank scales only its own hidden features,
so each rank's gradient of the gain is its part of a sum over tp (the shape of Qwen3's per-head q/k
norms, without transformers). With AOT_GAIN_ON_INPUT=1 the gain also scales the input, which every tp
rank holds whole: no single reduction of its gradient is right, and the build refuses it.
AOT_SUMMED (below) marks a module wrongly in tp_plan."""

import os

import torch
from torch import nn
from torch.nn import functional as F

n_in, n_hidden, n_classes = 16, 32, 5
ON_INPUT = os.environ.get("AOT_GAIN_ON_INPUT") == "1"


class GainedPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(n_in, n_hidden)
        self.down = nn.Linear(n_hidden, n_in)
        self.gain = nn.Parameter(torch.full((), 1.5))
        self.head = nn.Linear(n_in, n_classes)

    def forward(self, x):
        h = F.gelu(self.up(x)) * self.gain
        if ON_INPUT:
            x = x * self.gain
        return self.head(self.down(h) + x)


tp_plan = {"up": "colwise", "down": "rowwise"}
# AOT_SUMMED=head: the plan also marks `head` "replicated_with_grad_allreduce", wrongly (it runs on
# what every tp rank holds whole), which the build refuses
if os.environ.get("AOT_SUMMED"):
    tp_plan[os.environ["AOT_SUMMED"]] = "replicated_with_grad_allreduce"


def model():
    return GainedPair()


def batch(batch_size):
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch_size, n_in, generator=g), torch.randint(0, n_classes, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)

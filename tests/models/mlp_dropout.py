"""Two Megatron pairs (Linear column-wise -> GELU -> Linear row-wise) with dropout between them,
where tensor-parallel ranks hold the whole activation: their masks must be the same on every tp
rank and the same as eager PyTorch's with the runner's per-step seed (artifacts/FORMAT.md)."""

import torch
from torch import nn

n_in, n_hidden, n_classes = 32, 64, 10


def model():
    return nn.Sequential(
        nn.Linear(n_in, n_hidden),
        nn.GELU(),
        nn.Linear(n_hidden, n_in),
        nn.Dropout(0.2),
        nn.Linear(n_in, n_hidden),
        nn.GELU(),
        nn.Linear(n_hidden, n_classes),
    )


def batch(batch_size):
    g = torch.Generator().manual_seed(11)
    return torch.randn(batch_size, n_in, generator=g), torch.randint(0, n_classes, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)

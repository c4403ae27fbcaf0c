"""tp_plan names a module the model does not have (the MLP's layers are 0, 2 and 4)."""

import torch
from torch import nn

tp_plan = {"0": "colwise", "fc2": "rowwise"}


def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

"""A model with BatchNorm (buffers that change in training), Adam, a step schedule and clipping."""

import torch
from torch import nn

max_grad_norm = 0.5


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def batch(batch_size):
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

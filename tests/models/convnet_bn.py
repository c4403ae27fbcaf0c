"""A tiny convnet with BatchNorm2d (3x8x8 inputs, two conv layers, a linear head), for BatchNorm's
statistics: per rank as eager DDP, or over the data-parallel ranks with `aot build --sync-batchnorm`."""

import torch
from torch import nn


def model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def batch(batch_size):
    g = torch.Generator().manual_seed(3)
    # per-sample offsets, so ranks' batches have different statistics
    x = torch.randn(batch_size, 3, 8, 8, generator=g) + torch.randn(batch_size, 1, 1, 1, generator=g)
    return x, torch.randint(0, 5, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

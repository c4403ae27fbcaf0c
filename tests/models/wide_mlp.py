"""Sixteen wide Linear layers on a batch of two rows, trained by plain SGD: the gradients, not the
activations or an optimizer's state, are most of what a rank holds (tests/test_plan_search.py:
the least a pipeline rank holds)."""

import torch
from torch import nn

width, layers = 512, 16


def model():
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def batch(batch_size):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, width, generator=g)


def loss(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)

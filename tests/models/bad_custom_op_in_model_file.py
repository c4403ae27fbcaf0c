"""Defines its custom operator in the model file itself: the runner never imports model code."""

import torch
from torch import nn


@torch.library.custom_op("aot_tests_inline::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


double.register_autograd(lambda ctx, grad: grad * 2)


class Double(nn.Module):
    def forward(self, x):
        return double(x)


def model():
    return nn.Sequential(nn.Linear(8, 16), Double(), nn.Linear(16, 4))


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

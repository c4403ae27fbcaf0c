"""examples/custom_op.py without `onnx_translations`: trains, but its forward has no ONNX export."""

import torch
from torch import nn

from examples.custom_ops import swish


class Swish(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.beta = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return swish(x, self.beta)


def model():
    return nn.Sequential(nn.Linear(8, 16), Swish(16), nn.Linear(16, 4))


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

"""Bad model file for tests/test_bad_input.py: a parameter frozen with requires_grad_(False), which
eager training leaves alone and a step that trains every parameter would not: refused."""

import torch
from torch import nn


def model():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].weight.requires_grad_(False)
    return m


def batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))

"""Bad model file for tests/test_bad_input.py: trunc_normal_ drawing from a generator the model
keeps, which the runner (it seeds torch's global generator) cannot replay."""

import torch
from torch import nn


def model():
    m = nn.Linear(4, 2)
    nn.init.trunc_normal_(m.weight, generator=torch.Generator().manual_seed(1))  # MARK: own generator
    return m


def batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))

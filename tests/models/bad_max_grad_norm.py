"""Bad model file for tests/test_bad_input.py: max_grad_norm is a string."""

import torch
from torch import nn

max_grad_norm = "x"


def model():
    return nn.Linear(4, 3)


def batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))

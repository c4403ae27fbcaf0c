"""Bad model file for tests/test_bad_input.py: batch() inputs have 4 features, the model takes 5."""

import torch
from torch import nn


def model():
    return nn.Linear(5, 3)


def batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))

"""Bad model file for tests/test_bad_input.py: model() raises."""

import torch
from torch import nn

N_IN = 4


def model():
    raise RuntimeError("model() exploded on purpose")  # MARK: raises
    return nn.Linear(N_IN, 3)


def batch(batch_size):
    return torch.randn(batch_size, N_IN), torch.randint(0, 3, (batch_size,))

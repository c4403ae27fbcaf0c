"""Bad model file for tests/test_bad_input.py: Python control flow on a tensor's value,
which a static graph cannot hold."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:  # MARK: data-dependent
            return self.fc(x)
        return self.fc(-x)


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

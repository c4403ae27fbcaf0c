"""Bad model file for tests/test_bad_input.py: the constructor branches on a tensor's value,
which the build cannot know (it records model() on fake tensors, never running it for real)."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        if self.fc.weight.sum() > 0:  # MARK: reads values
            nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        return self.fc(x)


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

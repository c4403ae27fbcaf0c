"""Bad model file for tests/test_bad_input.py: a buffer that is a view of a parameter.

Tracing and export succeed; writing the weights fails (safetensors refuses tensors that share
memory), so the failure happens inside the artifact's staged write.
"""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("first_row", self.fc.weight.detach()[0])

    def forward(self, x):
        return self.fc(x) + self.first_row.sum()


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)

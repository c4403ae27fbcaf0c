"""Bad model file for tests/test_bad_input.py: a parameter made from a big tensor the constructor
got outside torch's factory functions (numpy here; a file read works the same way). An artifact
records how weights are made, not their values: such weights belong to `aot run --init-from`."""

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        table = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
        self.embedding = nn.Parameter(torch.from_numpy(table))
        self.head = nn.Linear(512, 3)

    def forward(self, x):
        return self.head(self.embedding[x])


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 1024, (batch_size,), generator=g), torch.randint(0, 3, (batch_size,), generator=g)

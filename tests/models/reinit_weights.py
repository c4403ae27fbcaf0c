"""A model built nanoGPT's way, for tests/test_init_program.py: its Linears are initialized by
their constructors, then every weight is drawn again by `_init_weights` after the whole model
exists; plus a causal mask buffer that no state_dict holds."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))
        self.register_buffer("mask", torch.tril(torch.ones(16, 16, dtype=torch.bool)), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 256, generator=g), torch.randint(0, 256, (batch_size,), generator=g)

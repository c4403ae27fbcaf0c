"""Blocks with dropout, each called through torch.utils.checkpoint(use_reentrant=False), as
transformers' gradient checkpointing calls its layers: for tests/test_recompute.py, where the
checkpoint calls become aot's recomputation, bit-identical to keeping every activation."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width=32, depth=3, classes=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 32, generator=g), torch.randint(0, 8, (batch_size,), generator=g)

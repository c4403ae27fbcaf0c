"""examples/gpt.py whose blocks also mix features with a Linear of their own between attention and
MLP, outside both: on a sequence-split residual stream its weight would see 1/tp of the tokens."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

from gpt import batch, loss, optimizer  # noqa: E402,F401

n_head = gpt.n_head


class MixedBlock(gpt.Block):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(gpt.n_embd, gpt.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + torch.tanh(self.mix(x))
        return x + self.mlp(self.ln2(x))


def model():
    m = gpt.model()
    m.blocks = nn.ModuleList(MixedBlock() for _ in range(gpt.n_layer))
    return m

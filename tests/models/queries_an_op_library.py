"""A model whose constructor imports a library that calls one of its own operators on import
(tests/helpers/query_op_library.py; transformers' GPT-2 on a machine with torchaudio does this).
That call must not end up in the artifact: the runner never imports the library."""

import importlib
import sys
from pathlib import Path

import torch
from torch import nn


def model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where helpers/ lives
    try:
        importlib.import_module("helpers.query_op_library")  # its call runs on first import: while traced
    finally:
        sys.path.pop(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

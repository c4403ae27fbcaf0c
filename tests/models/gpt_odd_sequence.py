"""examples/gpt.py with 63-token sequences: sequence parallelism over 2 ranks cannot split them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

from gpt import loss, model, optimizer  # noqa: E402,F401

n_head = gpt.n_head


def batch(batch_size):
    inputs, targets = gpt.batch(batch_size)
    return inputs[:, :63], targets[:, :63]

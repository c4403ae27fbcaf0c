"""Bad model file for tests/test_bad_input.py: defines batch() but no model()."""

import torch


def batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))

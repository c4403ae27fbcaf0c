"""Bad model file for tests/test_bad_input.py: defines model() but no batch()."""

from torch import nn


def model():
    return nn.Linear(4, 3)

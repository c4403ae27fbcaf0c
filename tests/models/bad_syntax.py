"""Bad model file for tests/test_bad_input.py: a syntax error on line 5."""
import torch


def model(:
    return torch.nn.Linear(4, 3)

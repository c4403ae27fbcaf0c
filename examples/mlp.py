"""A small MLP classifier: the simplest example model for `aot`.

A model file is a plain Python module with these module-level names:

    model()            -> torch.nn.Module      (required; do not seed inside)
    batch(batch_size)  -> (inputs, targets)    (required; deterministic example batch)
    optimizer(params)  -> torch.optim.Optimizer (optional; default: AdamW, lr=1e-3)
    loss(outputs, targets) -> scalar tensor    (optional; default: cross-entropy)
    scheduler(optimizer), max_grad_norm        (optional)
"""

import torch
from torch import nn

n_in, n_hidden, n_classes = 32, 64, 10


def model():
    return nn.Sequential(
        nn.Linear(n_in, n_hidden),
        nn.ReLU(),
        nn.Linear(n_hidden, n_hidden),
        nn.ReLU(),
        nn.Linear(n_hidden, n_classes),
    )


def batch(batch_size):
    # A local generator keeps the example batch independent of the global RNG.
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(batch_size, n_in, generator=g)
    targets = torch.randint(0, n_classes, (batch_size,), generator=g)
    return inputs, targets


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)

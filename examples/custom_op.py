"""A model with a custom operator: an MLP whose activation is `aot_examples::swish`, defined with
torch.library.custom_op in the op library examples/custom_ops.py.

Build and train it from the repository root, so that `examples.custom_ops` is importable (the
runner imports the op library by that name before it loads the program):

    python -m aot build examples/custom_op.py --world-size 2 -o artifacts/custom_op
    torchrun --nproc-per-node 2 -m aot run artifacts/custom_op --steps 20
    python -m aot infer artifacts/custom_op --input artifacts/custom_op/data/example_batch.safetensors

Two optional model-file names serve custom operators:
- `custom_op_modules`: the modules that register them. Operators defined with
  torch.library.custom_op are traced back to their module on their own; listing it here too is
  documentation (and required for operators registered any other way, e.g. in C++).
- `onnx_translations`: operator -> ONNX translation (an onnxscript function over ONNX operators),
  used by the ONNX export of the forward. Without one the build warns and skips the export.
"""

import torch
from torch import nn

from examples.custom_ops import swish

custom_op_modules = ["examples.custom_ops"]

n_in, n_hidden, n_classes = 32, 64, 10


class Swish(nn.Module):
    """The custom operator with a learnable slope per feature (its gradient comes from the op's
    registered backward)."""

    def __init__(self, features):
        super().__init__()
        self.beta = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return swish(x, self.beta)


def model():
    return nn.Sequential(
        nn.Linear(n_in, n_hidden),
        Swish(n_hidden),
        nn.Linear(n_hidden, n_hidden),
        Swish(n_hidden),
        nn.Linear(n_hidden, n_classes),
    )


def batch(batch_size):
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(batch_size, n_in, generator=g)
    targets = torch.randint(0, n_classes, (batch_size,), generator=g)
    return inputs, targets


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def onnx_translations():
    """Called by the ONNX export only, so training never imports onnxscript."""
    from onnxscript import opset18 as op

    def swish_onnx(x, beta):
        return op.Mul(x, op.Sigmoid(op.Mul(beta, x)))

    return {torch.ops.aot_examples.swish.default: swish_onnx}

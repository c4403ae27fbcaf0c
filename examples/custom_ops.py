"""An op library: a custom operator, `aot_examples::swish`, registered with torch.library.

    swish(x, beta) = x * sigmoid(beta * x)        (beta: one learnable slope per feature)

What makes a custom operator work with aot:
- `torch.library.custom_op` defines it; torch treats it as one opaque operator, in the traced
  training step as in eager code.
- `register_fake` gives its output's shape and dtype, so it traces on fake tensors.
- `register_autograd` gives its backward, so it trains (here the backward is made of ordinary
  torch operators, which end up in the step's graph).
- It lives in its own module, not in the model file: the runner never imports model code, so it
  imports this module (by the name recorded in the artifact's manifest, `examples.custom_ops`)
  before it loads the program. The module must be importable where the artifact runs.

Its ONNX translation, which only the build needs, is in the model file (examples/custom_op.py).
"""

import torch


@torch.library.custom_op("aot_examples::swish", mutates_args=())
def swish(x: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(beta * x)


@swish.register_fake
def _(x, beta):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, beta = inputs
    ctx.save_for_backward(x, beta)


def _backward(ctx, grad):
    x, beta = ctx.saved_tensors
    s = torch.sigmoid(beta * x)
    ds = s * (1 - s)
    grad_x = grad * (s + beta * x * ds)
    # beta broadcasts over every dimension but the last: sum its gradient over them
    grad_beta = (grad * x * x * ds).reshape(-1, beta.shape[-1]).sum(0)
    return grad_x, grad_beta


swish.register_autograd(_backward, setup_context=_setup_context)

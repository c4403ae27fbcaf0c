"""SyncBatchNorm inside the captured step: batch statistics over the data-parallel ranks.

Plain BatchNorm normalizes each rank's batch by that batch's own statistics, as eager DDP does.
`nn.SyncBatchNorm` (in the model, or every BatchNorm converted by `aot build --sync-batchnorm`)
computes them over the ranks that hold different samples: the dp and fsdp groups, not tp (tp
ranks share a batch). Eager SyncBatchNorm cannot be traced into a static graph: its CPU forward
raises once a process group exists, and its CUDA kernels reach c10d outside any graph. So while
the step is traced, each SyncBatchNorm's forward is replaced by the same mathematics with
functional collectives, which become graph nodes like the gradient all_reduces (and may share
their buckets, aot/passes/bucketing.py):

- forward: per channel, this rank's sum and sum of squares (shifted by the running mean, which
  every rank holds alike, so the subtraction does not cancel digits) are all-reduced over each
  data-parallel group; the count is a constant (the graph's shapes are static, every rank's batch
  has the same size). Mean and biased variance normalize; the running statistics are updated
  with the unbiased variance of the whole group's batch, as SyncBatchNorm does.
- backward: autograd through the all_reduce, whose registered backward (torch 2.13,
  torch/distributed/_functional_collectives.py) all-reduces the gradient with the same "sum":
  the sum_dy and sum_dy_xmu terms of SyncBatchNorm's backward, summed over the group.

With equal batches per rank this is exactly BatchNorm over the concatenated global batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the all_reduce's autograd)
from torch import nn

from aot.errors import AotError

_funcol = torch.ops._c10d_functional


def batchnorm_layers(model: nn.Module) -> dict[str, bool]:
    """Every BatchNorm layer (BatchNorm1d/2d/3d, SyncBatchNorm) by name -> whether it is a SyncBatchNorm."""
    return {name: isinstance(m, nn.SyncBatchNorm) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def convert_to_sync(model: nn.Module, model_name: str) -> nn.Module:
    """`aot build --sync-batchnorm`: torch's own conversion of every BatchNorm to SyncBatchNorm
    (the same parameters and buffers under the same names)."""
    if not batchnorm_layers(model):
        raise AotError(f"--sync-batchnorm: {model_name} has no BatchNorm layer to convert")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _sum_over(t: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        t = _funcol.wait_tensor(_funcol.all_reduce(t, "sum", group.name))
    return t


class _RunningStats(NamedTuple):
    mean: torch.Tensor
    var: torch.Tensor
    batches: torch.Tensor  # num_batches_tracked


def _running_stats(module: nn.SyncBatchNorm) -> _RunningStats | None:
    """The buffers the layer updates in training mode, if it tracks running statistics."""
    if not (module.track_running_stats and module.running_mean is not None):
        return None
    # _BatchNorm registers running_var and num_batches_tracked together with running_mean
    assert module.running_var is not None and module.num_batches_tracked is not None
    return _RunningStats(module.running_mean, module.running_var, module.num_batches_tracked)


def _forward(module: nn.SyncBatchNorm, groups, input: torch.Tensor) -> torch.Tensor:
    """SyncBatchNorm.forward in training mode over `groups` (each with .name and .size)."""
    module._check_input_dim(input)
    module._check_non_zero_input_channels(input)
    running = _running_stats(module)
    factor: float | torch.Tensor = 0.0  # read only with running statistics
    if running is not None:
        running.batches.add_(1)
        # momentum None: cumulative moving average
        factor = 1.0 / running.batches if module.momentum is None else module.momentum
    channels = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, channels] + [1] * (input.dim() - 2)
    x = input.float()  # statistics in fp32 under autocast too, as eager BatchNorm keeps them
    count = input.numel() // channels * math.prod(g.size for g in groups)
    if count <= 1:
        raise AotError(f"SyncBatchNorm: expected more than 1 value per channel over the data-parallel ranks, got input of size {list(input.shape)}")
    shift = running.mean.detach().clone().float() if running is not None else x.new_zeros(channels)
    centered = x - shift.view(shape)
    sums = _sum_over(torch.cat([centered.sum(dims), (centered * centered).sum(dims)]), groups)
    mean_shifted, square_mean = sums[:channels] / count, sums[channels:] / count
    var = torch.clamp(square_mean - mean_shifted * mean_shifted, min=0.0)  # biased: what normalizes
    if running is not None:
        with torch.no_grad():
            mean, unbiased = (mean_shifted + shift).to(running.mean.dtype), var * (count / (count - 1))
            running.mean.mul_(1 - factor).add_(mean * factor)
            running.var.mul_(1 - factor).add_(unbiased.to(running.var.dtype) * factor)
    out = (centered - mean_shifted.view(shape)) * torch.rsqrt(var + module.eps).view(shape)
    if module.weight is not None:
        out = out * module.weight.view(shape) + module.bias.view(shape)
    return out.to(input.dtype)


@contextlib.contextmanager
def sync_batchnorm_in_graph(model: nn.Module, groups):
    """While the step is traced: every SyncBatchNorm of `model` in training mode computes its
    statistics with functional all_reduces over `groups` (the data-parallel groups; none: this
    rank's batch is the whole batch). Eval mode keeps torch's forward (running statistics)."""
    groups = list(groups)
    patched = []

    def forward_of(module):
        original = type(module).forward

        def forward(input):
            return _forward(module, groups, input) if module.training else original(module, input)

        return forward

    for module in model.modules():
        if isinstance(module, nn.SyncBatchNorm):
            # an instance attribute in front of the class's forward; `del` below uncovers it again
            module.forward = forward_of(module)  # type: ignore[method-assign]
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def manifest_entry(model: nn.Module, data_axes: list[str]) -> dict | None:
    """The manifest's optional `batchnorm` (artifacts/FORMAT.md): how many BatchNorm layers,
    how many of them SyncBatchNorm, and the mesh axes those compute their statistics over."""
    layers = batchnorm_layers(model)
    if not layers:
        return None
    return {"layers": len(layers), "synced": sum(layers.values()), "axes": list(data_axes)}

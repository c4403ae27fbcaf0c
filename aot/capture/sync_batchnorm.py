"""SyncBatchNorm inside the captured step: batch statistics over the data-parallel ranks.

Plain BatchNorm normalizes each rank's batch by that batch's own statistics, as eager DDP does.
`nn.SyncBatchNorm` (in the model, or every BatchNorm converted by `aot build --sync-batchnorm`)
computes them over the ranks that hold different samples: the dp and fsdp groups, not tp (tp
ranks share a batch). Eager SyncBatchNorm cannot be traced into a static graph: its CPU forward
raises once a process group exists, and its CUDA kernels reach c10d outside any graph. So while
the step is traced, each SyncBatchNorm's forward is replaced by the same mathematics with
functional collectives, which become graph nodes like the gradient all_reduces (and may share
their buckets, aot/passes/bucketing.py):

- forward: per channel, this rank's mean and sum of squared deviations from it (two passes over
  its own batch, as eager BatchNorm computes them) are all-gathered over each data-parallel group
  and combined as torch's SyncBatchNorm does (`batch_norm_gather_stats_with_counts`, Chan et al.'s
  pairwise formula): the group's mean is the mean of the ranks' means, its sum of squares the sum
  of theirs plus each rank's count times its mean's squared distance from the group's. The count
  is a constant (the graph's shapes are static, every rank's batch has the same size). Mean and
  biased variance normalize; the running statistics are updated with the unbiased variance of the
  whole group's batch, as SyncBatchNorm does. (An earlier version all-reduced sums and sums of
  squares about the running mean: one fewer pass, but the variance then cancels digits wherever a
  channel's mean is far from its running mean, which on a deep ResNet made steps 1e-3 apart from
  one process over the global batch, issue #39.)
- backward: autograd through the all_gather, whose registered backward (torch 2.13,
  torch/distributed/_functional_collectives.py) reduce-scatters the gradient (a sum): every
  rank's terms of SyncBatchNorm's backward, summed over the group.

With equal batches per rank this is exactly BatchNorm over the concatenated global batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the all_reduce's autograd)
from torch import nn

from aot.capture.module_calls import forwards_replaced
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


def _combine(mean: torch.Tensor, m2: torch.Tensor, count: int, groups) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean, sum of squared deviations, count) per channel over every rank of `groups`, from this
    rank's: all-gathered (each rank's `count` values alike) and combined pairwise-stably."""
    for group in groups:
        pieces = _funcol.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(torch.stack([mean, m2]), group.size, group.name))
        means, m2s = pieces.view(group.size, 2, -1).unbind(1)
        mean = means.mean(0)
        m2 = m2s.sum(0) + count * ((means - mean) ** 2).sum(0)
        count *= group.size
    return mean, m2, count


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
    local = input.numel() // channels
    if local * math.prod(g.size for g in groups) <= 1:
        raise AotError(f"SyncBatchNorm: expected more than 1 value per channel over the data-parallel ranks, got input of size {list(input.shape)}")
    local_mean = x.mean(dims)
    local_m2 = ((x - local_mean.view(shape)) ** 2).sum(dims)
    mean, m2, count = _combine(local_mean, local_m2, local, groups)
    var = m2 / count  # biased: what normalizes
    if running is not None:
        with torch.no_grad():
            unbiased = m2 / (count - 1)
            running.mean.mul_(1 - factor).add_(mean.to(running.mean.dtype) * factor)
            running.var.mul_(1 - factor).add_(unbiased.to(running.var.dtype) * factor)
    out = (x - mean.view(shape)) * torch.rsqrt(var + module.eps).view(shape)
    if module.weight is not None:
        out = out * module.weight.view(shape) + module.bias.view(shape)
    return out.to(input.dtype)


def sync_batchnorm_in_graph(model: nn.Module, groups):
    """While the step is traced: every SyncBatchNorm of `model` in training mode computes its
    statistics with functional all_reduces over `groups` (the data-parallel groups; none: this
    rank's batch is the whole batch). Eval mode keeps torch's forward (running statistics)."""
    groups = list(groups)

    def forward_of(module):
        original = type(module).forward

        def forward(input):
            return _forward(module, groups, input) if module.training else original(module, input)

        return forward

    return forwards_replaced({module: forward_of(module) for module in model.modules() if isinstance(module, nn.SyncBatchNorm)})


def manifest_entry(model: nn.Module, data_axes: list[str]) -> dict | None:
    """The manifest's optional `batchnorm` (artifacts/FORMAT.md): how many BatchNorm layers,
    how many of them SyncBatchNorm, and the mesh axes those compute their statistics over."""
    layers = batchnorm_layers(model)
    if not layers:
        return None
    return {"layers": len(layers), "synced": sum(layers.values()), "axes": list(data_axes)}

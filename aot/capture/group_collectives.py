"""The step's collectives over one process group, as graph nodes (functional collectives): a sum,
a mean in the reduce dtype, fsdp's gather of a parameter whose backward reduce-scatters its
gradient, a sum over several groups in turn, and expert parallelism's all_to_all of equal chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aot.capture.precision import Precision

_funcol = torch.ops._c10d_functional
_funcol_autograd = torch.ops._c10d_functional_autograd


@dataclass(frozen=True)
class Group:
    """A process group as the graph names it, and how many ranks it has."""

    name: str
    size: int


def sum_over(t: torch.Tensor, group: Group) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(t, "sum", group.name))


def average(t: torch.Tensor, group: Group, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mean of `t` over `group`, summed in `dtype` (the precision's reduce dtype) when given:
    DDP's bf16 compression hook, which casts back to the gradient's own dtype after."""
    sent = t if dtype is None or t.dtype == dtype else t.to(dtype)
    summed = sum_over(sent, group).to(t.dtype)
    return summed / group.size


class _GatherInDtype(torch.autograd.Function):
    """FSDP2's MixedPrecisionPolicy for one parameter: all-gather the fp32 shard cast to
    `param_dtype`; backward reduce-scatters the (param_dtype) gradient cast to `reduce_dtype`
    and returns it in the shard's dtype. Traced through by make_fx like any autograd code."""

    @staticmethod
    def forward(ctx, piece, group_size: int, group_name: str, param_dtype, reduce_dtype):
        ctx.group = (group_size, group_name)
        ctx.dtypes = (reduce_dtype, piece.dtype)
        return _funcol.wait_tensor(_funcol.all_gather_into_tensor(piece.to(param_dtype), group_size, group_name))

    @staticmethod
    def backward(ctx, grad):
        (size, name), (reduce_dtype, dtype) = ctx.group, ctx.dtypes
        scattered = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(grad.to(reduce_dtype), "sum", size, name))
        return scattered.to(dtype), None, None, None, None


def gather_shard(piece: torch.Tensor, shape: torch.Size, group: Group, precision: Precision) -> torch.Tensor:
    """The whole parameter (of `shape`) from this rank's shard. The autograd variant of all_gather
    makes backward reduce-scatter the gradient, so it arrives summed over the group and sharded.
    With mixed precision the gather carries the compute dtype and the scatter the reduce dtype."""
    if precision.mixed:
        gathered = _GatherInDtype.apply(piece, group.size, group.name, precision.compute_dtype, precision.reduce_dtype)
    else:
        gathered = _funcol.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(piece, group.size, group.name))
    return gathered[: shape.numel()].view(shape)


def sum_over_groups(t: torch.Tensor, groups) -> torch.Tensor:
    """`t` summed over each of `groups` (Group or None) in turn."""
    for group in groups:
        if group is not None:
            t = sum_over(t, group)
    return t


def exchange(rows: torch.Tensor, ranks: int, group: str) -> torch.Tensor:
    """all_to_all of equal chunks along dim 0 (chunk r to ep rank r); its gradient travels back the same way."""
    splits = [rows.shape[0] // ranks] * ranks
    return _funcol.wait_tensor(_funcol_autograd.all_to_all_single(rows.contiguous(), splits, splits, group))

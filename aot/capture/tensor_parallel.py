"""Tensor parallelism inside the captured step, by torch's own DTensor machinery.

A copy of the model is parallelized with `parallelize_module` (ColwiseParallel / RowwiseParallel
per the plan) on a one-axis device mesh over a fake process group, so nothing runs. During capture
each sharded parameter enters the graph as this rank's local shard and is wrapped as a DTensor
with its placement; DTensor's sharding propagation then puts the collectives in the graph (the
row-wise layers' output all-reduce, the column-wise layers' input-gradient all-reduce). The mesh's
process group carries a process-local name; the graph is renamed to the mesh axis's canonical
name ("aot.tp") that the runner binds.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from aot.errors import AotError

_funcol = torch.ops._c10d_functional

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


@dataclass
class TensorParallel:
    """The parallelized model copy and, per sharded parameter, the dimension it is split along."""

    model: nn.Module
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    size: int
    group: str  # the canonical name the graph will carry
    dims: dict[str, int]  # parameter name -> sharded dimension
    placements: dict[str, tuple]  # parameter name -> DTensor placements (Shard or Replicate)

    def wrap(self, tensors: dict[str, torch.Tensor], full_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        """The parameters as the parallelized modules expect them: DTensors (built from this
        rank's local pieces, differentiably) where a style placed them, plain tensors elsewhere."""
        from torch.distributed.tensor import DTensor

        result = dict(tensors)
        for name, placements in self.placements.items():
            shape = full_shapes[name]
            result[name] = DTensor.from_local(
                tensors[name], self.mesh, placements, run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
            )
        return result


def _styles(plan: dict[str, str], sequence: dict | None) -> dict:
    """torch's parallel styles for each module. Without sequence parallelism: column-wise and
    row-wise Linears (row-wise outputs all-reduced). With it (`sequence`, from
    aot.plan.tensor_parallel.sequence_parallel_layout): the first block takes its input's
    sequence slice, the last block's output is all-gathered whole, each attention or MLP module
    all-gathers its input along the sequence and its row-wise layer reduce-scatters its output
    back, and the blocks' norms run on their slice of the tokens (SequenceParallel). Entering and
    leaving the split stream (first block's input, last block's output) are `_stream_hooks`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    if sequence is None:
        return {name: ColwiseParallel() if style == "colwise" else RowwiseParallel() for name, style in plan.items()}
    styles = {name: ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=Shard(1)) for name, style in plan.items()}
    for region in sequence["regions"]:
        styles[region] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for norm in sequence["norms"]:
        styles[norm] = SequenceParallel()
    return styles


# Entering and leaving the sequence-split stream. DTensor's Replicate -> Shard(1) takes "this
# rank's" slice by the mesh coordinate known at trace time, which would bake rank 0's slice into
# the one program every rank runs; these use collectives instead, which pick each rank's piece at
# run time. Exact for power-of-two tp (x / tp summed tp times is x).


def _scale_grad(t: torch.Tensor, factor: float) -> torch.Tensor:
    """`t` forward; its gradient times `factor` backward."""
    return t.detach() + (t - t.detach()) * factor


def split_sequence(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """A tensor every tp rank holds whole -> this rank's slice along dim 1 (a reduce-scatter of
    x / size). Backward all-gathers the slices' gradients: each rank's whole-tensor gradient."""
    y = (_scale_grad(x, size) / size).movedim(1, 0).contiguous()
    y = _funcol.wait_tensor(torch.ops._c10d_functional_autograd.reduce_scatter_tensor(y, "sum", size, group))
    return y.movedim(0, 1)


def gather_sequence(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    """This rank's slice along dim 1 -> the whole tensor on every tp rank (all-gather). Backward
    reduce-scatters the (equal) gradients of the whole, scaled so each slice gets its own once."""
    y = x.movedim(1, 0).contiguous()
    y = _funcol.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(y, size, group))
    return _scale_grad(y.movedim(0, 1), 1.0 / size)


def _stream_hooks(model: nn.Module, sequence: dict, size: int, group: str) -> None:
    modules = dict(model.named_modules())
    first, last = modules[sequence["blocks"][0]], modules[sequence["blocks"][-1]]
    first.register_forward_pre_hook(lambda m, args: (split_sequence(args[0], size, group), *args[1:]))
    last.register_forward_hook(lambda m, args, out: gather_sequence(out, size, group))


@contextlib.contextmanager
def tensor_parallel(model: nn.Module, plan: dict[str, str], size: int, group: str, sequence: dict | None = None, rank: int = 0):
    """Yield a TensorParallel for `model` under `plan` (and the sequence-parallel layout, if any);
    the fake process group lives as long as the context, so capture happens inside it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise AotError("tensor parallel capture needs its own (fake) process group, but one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        mesh = DeviceMesh("cpu", list(range(size)))
        # A copy of the modules that shares their (fake) tensors: parallelize_module swaps the copy's
        # parameters for DTensors and leaves the model's own; fake tensors cannot be deep-copied.
        parallel = copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})
        parallelize_module(parallel, mesh, _styles(plan, sequence))
        if sequence is not None:
            _stream_hooks(parallel, sequence, size, mesh.get_group().group_name)
        dims, placements = {}, {}
        for name, param in parallel.named_parameters(remove_duplicate=False):
            if isinstance(param, DTensor):
                placements[name] = tuple(param.placements)
                sharded = [p.dim for p in param.placements if p.is_shard()]
                if sharded:
                    dims[name] = sharded[0]
        yield TensorParallel(parallel, mesh, size, group, dims, placements)
    finally:
        dist.destroy_process_group()


def rename_group(graph: torch.fx.GraphModule, old: str, new: str) -> None:
    """Give the collectives of `old` (a process-local name) the canonical name the runner binds."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            node.args = tuple(new if a == old else a for a in node.args)
    graph.recompile()

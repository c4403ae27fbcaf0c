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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle as ParallelStyleBase

from aot.capture.graph_reading import COLLECTIVE_NAMESPACES
from aot.capture.fake_group import fake_process_group
from aot.errors import AotError
from runner.format.sharding import tp_style

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

_funcol = torch.ops._c10d_functional


@dataclass
class TensorParallel:
    """The parallelized model copy and, per sharded parameter, the dimension it is split along."""

    model: nn.Module
    mesh: DeviceMesh
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


def transposed_linear(module) -> bool:
    """transformers' Conv1D (GPT-2's layers): a Linear whose weight is stored (in, out) and applied
    as addmm(bias, x, weight). Recognized by its name and shape: aot does not import transformers."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 and hasattr(module, "nf")


class FusedSplits:
    """The local output of each fused column-wise layer ("colwise:K", GPT-2's c_attn) and its K.

    The model's own code cuts that output into its K parts with the whole layer's sizes
    (`.split(n_embd, dim=2)`); on a rank, which holds a slice of every part (runner.format.sharding.tp_slice),
    the same cut must take the slice's sizes. While the capture runs, `split` calls on a registered
    output have their sizes divided by the tp degree (chunk(K) needs nothing: it counts parts)."""

    def __init__(self, size: int):
        from torch.utils.weak import WeakTensorKeyDictionary

        self.size = size
        self.outputs = WeakTensorKeyDictionary()

    def register(self, local: torch.Tensor, parts: int) -> None:
        self.outputs[local] = parts

    def mode(self):
        from torch.overrides import TorchFunctionMode

        splits = self

        class LocalSplitSizes(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in (torch.Tensor.split, torch.split) and args and isinstance(args[0], torch.Tensor) and args[0] in splits.outputs:
                    args, kwargs = splits._local(args, kwargs)
                return func(*args, **kwargs)

        return LocalSplitSizes()

    def _local(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensor, parts = args[0], self.outputs[args[0]]
        key = next((k for k in ("split_size", "split_size_or_sections") if k in kwargs), None)
        sizes = kwargs[key] if key else args[1]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        whole = tensor.shape[dim] * self.size
        if isinstance(sizes, int) and sizes * parts == whole:
            sizes = sizes // self.size
        elif isinstance(sizes, (list, tuple)) and len(sizes) == parts and all(n * parts == whole for n in sizes):
            sizes = [n // self.size for n in sizes]
        else:
            raise AotError(f"tensor parallel: a fused layer's output ({parts} parts of {whole // parts}) is split by {sizes}, not into its parts")
        if key:
            return args, {**kwargs, key: sizes}
        return (tensor, sizes, *args[2:]), kwargs


def _styles(plan: dict[str, str], sequence: dict | None, splits: FusedSplits) -> dict[str, ParallelStyle]:
    """torch's parallel styles for each module. Without sequence parallelism: column-wise and
    row-wise layers (row-wise outputs all-reduced). With it (`sequence`, from
    aot.plan.sequence_parallel.sequence_parallel_layout): the first block takes its input's
    sequence slice, the last block's output is all-gathered whole, each attention or MLP module
    all-gathers its input along the sequence and its row-wise layer reduce-scatters its output
    back, and the blocks' norms run on their slice of the tokens (SequenceParallel). Entering and
    leaving the split stream (first block's input, last block's output) are `_stream_hooks`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        kind, parts = tp_style(style)
        if kind == "colwise":
            styles[name] = _Colwise(parts, splits)
        else:
            styles[name] = _Rowwise() if sequence is None else _Rowwise(output_layouts=Shard(1))
    if sequence is None:
        return styles
    for region in sequence["regions"]:
        styles[region] = _GatherSequenceInput()
    for norm in sequence["norms"]:
        styles[norm] = SequenceParallel()
    return styles


class _GatherSequenceInput(ParallelStyleBase):
    """torch's PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for a region's input (its sequence slices all-gathered), whether the module takes it by
    position (examples/gpt.py's `self.attn(x)`) or by keyword (transformers' attention is called
    with `hidden_states=...`, which PrepareModuleInput's positional layouts refuse): the first
    positional argument, else the `hidden_states` keyword, else the first tensor keyword."""

    def _apply(self, module: nn.Module, device_mesh):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def whole(x):
            if not isinstance(x, torch.Tensor):
                return x
            dt = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return dt.redistribute(device_mesh, (Replicate(),))

        def hook(mod, args, kwargs):
            if args:
                return (whole(args[0]), *args[1:]), kwargs
            name = "hidden_states" if "hidden_states" in kwargs else next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
            return (args, kwargs) if name is None else (args, {**kwargs, name: whole(kwargs[name])})

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _distribute(module: nn.Module, placements: Mapping[str, Placement], mesh) -> None:
    """Each of the module's own parameters as a DTensor with its placement."""
    from torch.distributed.tensor import distribute_tensor

    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad))


class _Colwise(ColwiseParallel):
    """torch's ColwiseParallel, also for transformers' Conv1D (weight split along dim 1, its
    output features) and for fused layers, whose local outputs `splits` learns."""

    def __init__(self, parts: int, splits: FusedSplits):
        super().__init__()
        self.parts, self.splits = parts, splits

    def _apply(self, module: nn.Module, device_mesh):
        from functools import partial

        from torch.distributed.tensor import Shard, distribute_module

        if not transposed_linear(module) and self.parts == 1:
            return super()._apply(module, device_mesh)
        placements = {"weight": Shard(1), "bias": Shard(0)} if transposed_linear(module) else {"weight": Shard(0), "bias": Shard(0)}
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _distribute(m, placements, mesh),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            self._output,
        )

    def _output(self, module, outputs, device_mesh):
        local = self._prepare_output_fn(self.output_layouts, self.use_local_output, module, outputs, device_mesh)
        if self.parts > 1:
            self.splits.register(local, self.parts)
        return local


class _Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, also for transformers' Conv1D (weight split along dim 0, its input features)."""

    def _apply(self, module: nn.Module, device_mesh):
        from functools import partial

        from torch.distributed.tensor import Replicate, Shard, distribute_module

        if not transposed_linear(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _distribute(m, {"weight": Shard(0), "bias": Replicate()}, mesh),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


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
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    with fake_process_group(rank, size, "tensor parallel capture"):
        mesh = DeviceMesh("cpu", list(range(size)))
        # A copy of the modules that shares their (fake) tensors: parallelize_module swaps the copy's
        # parameters for DTensors and leaves the model's own; fake tensors cannot be deep-copied.
        parallel = copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})
        splits = FusedSplits(size)
        parallelize_module(parallel, mesh, _styles(plan, sequence, splits))
        if sequence is not None:
            _stream_hooks(parallel, sequence, size, mesh.get_group().group_name)
        dims, placements = {}, {}
        for name, param in parallel.named_parameters(remove_duplicate=False):
            if isinstance(param, DTensor):
                placements[name] = tuple(param.placements)
                sharded = [p.dim for p in param.placements if isinstance(p, Shard)]  # is_shard()'s test, which also types p.dim
                if sharded:
                    dims[name] = sharded[0]
        with splits.mode():
            yield TensorParallel(parallel, mesh, size, group, dims, placements)


def rename_group(graph: torch.fx.GraphModule, old: str, new: str) -> None:
    """Give the collectives of `old` (a process-local name) the canonical name the runner binds."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES:
            node.args = tuple(new if a == old else a for a in node.args)
    graph.recompile()

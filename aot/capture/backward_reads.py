"""Which parameters a model's backward reads: those autograd saves from the forward.

A layer's backward reads its weight to make its input's gradient (a linear layer's, a norm's
scale), but not to make the weight's own (a bias, an embedding table, a first layer whose input
needs no gradient). Where parameters are gathered (fsdp), a gathered weight the backward reads
is held from the forward to its backward; one it does not read can be freed after the forward.
The planner's floor on a pipeline rank's memory (aot/plan/pipeline_floor.py) counts the first
kind only.

Found by running the model's forward and loss once on its fake tensors (no memory, no kernels)
with a hook on every tensor autograd saves, each traced back through its views to the parameter
it reads; and which parameters the loss reaches at all (the others get no gradient), by a walk of
autograd's graph from the loss. Parameter-wise, not tensor-parallel- or precision-wise: a sharded or cast weight is read
where the whole one is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aot.capture.model_file import ModelFile
from aot.capture.step import traced_as_compiled
from aot.capture.trace_logs import quiet_trace_logs
from aot.capture.training_state import TrainingState


@dataclass(frozen=True)
class BackwardReads:
    """Of a model's parameters (names): those the loss reaches (they get a gradient), and those
    whose values the backward reads."""

    reached: frozenset[str]
    read: frozenset[str]


def parameters_read_in_backward(mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor) -> BackwardReads | None:
    """Which parameters the loss of one row of the batch reaches, and which its backward reads;
    None where the forward cannot run on fake tensors outside a trace (a value read as a Python
    number): then the caller knows nothing of it."""
    fake_mode = torch._guards.detect_fake_mode(list(state.params.values()))
    if fake_mode is None:
        return None
    leaves = {name: p.detach().requires_grad_(p.is_floating_point()) for name, p in state.params.items()}
    name_of = {id(leaf): name for name, leaf in leaves.items()}
    read: set[str] = set()

    def saved(tensor: torch.Tensor) -> torch.Tensor:
        base: torch.Tensor | None = tensor
        while base is not None and id(base) not in name_of:
            base = base._base
        if base is not None:
            read.add(name_of[id(base)])
        return tensor

    try:
        with fake_mode, traced_as_compiled(), quiet_trace_logs():
            rows = [fake_mode.from_tensor(x)[:1] for x in inputs]
            with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
                outputs = torch.func.functional_call(state.model, {**leaves, **state.buffers}, tuple(rows))
                loss = mf.loss(outputs, fake_mode.from_tensor(targets)[:1])
    except Exception:  # noqa: BLE001  (a model whose forward needs a trace: nothing is known)
        return None
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return None
    return BackwardReads(frozenset(_reached(loss.grad_fn, name_of)), frozenset(read))


def _reached(root, name_of: dict[int, str]) -> set[str]:
    """The parameters whose gradient accumulators autograd's graph from `root` reaches: a walk
    of the graph, nothing computed."""
    reached, seen, todo = set(), set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: its leaf
        if variable is not None and id(variable) in name_of:
            reached.add(name_of[id(variable)])
        todo.extend(next_node for next_node, _ in node.next_functions)
    return reached

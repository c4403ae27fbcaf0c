"""Capture of the eval program: the training step's forward and loss with the model in eval mode
(dropout off, BatchNorm reading its running statistics), no gradient, no optimizer, nothing
updated, on the same sharding and precision as the training step (fsdp gathers each parameter,
tp runs the same split layers, autocast the same rules).

It returns `(loss, global_loss)` as the training program does: this rank's loss and its mean
over the data-parallel ranks (fsdp, then dp), so a validation loss is the mean of global_loss
over a fixed list of batches. `aot run --eval-data` and `aot eval` run it
(runner/execution/evaluation.py); artifacts/FORMAT.md, "Eval program", is its contract.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from aot.capture.group_collectives import average, gather_shard
from aot.capture.model_file import ModelFile
from aot.capture.step import (
    _funcol,
    CapturedStep,
    StepLayout,
    _capture_tp,
    _slot,
    experts_of,
    forward_and_loss,
    rank_state,
    trace_user_code,
)
from aot.capture.tensor_parallel import TensorParallel
from aot.capture.training_state import TrainingState

EVAL_PROGRAM = "eval"


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """`model.eval()` while the eval program is traced, each module's own mode restored after (a
    model may keep a submodule in eval mode while training)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def eval_program(mf: ModelFile, state: TrainingState, n_inputs: int, layout: StepLayout, tp: TensorParallel | None):
    """The eval step as a function of its flat inputs (`eval_args`)."""
    param_names, buffer_names = list(state.params), list(state.buffers)
    n_params, n_buffers = len(param_names), len(buffer_names)
    local_shapes = layout.local_shapes(state)
    full_shapes = {n: p.shape for n, p in state.params.items()}
    model = state.model if tp is None else tp.model

    def evaluate(*flat):
        by_name = dict(zip(param_names, flat[:n_params]))
        buffers = dict(zip(buffer_names, flat[n_params : n_params + n_buffers]))
        batch_inputs, batch_targets = flat[-1 - n_inputs : -1], flat[-1]
        used = by_name if layout.fsdp is None else {n: gather_shard(p, local_shapes[n], layout.fsdp, layout.precision) for n, p in by_name.items()}
        if tp is not None:
            used = tp.wrap(used, full_shapes)
        local_loss = forward_and_loss(mf, model, layout.precision, {**used, **buffers}, batch_inputs, batch_targets).detach()
        global_loss = local_loss
        for group in (layout.fsdp, layout.dp, layout.ep):  # the training step's order
            if group is not None:
                global_loss = average(global_loss, group)
        return local_loss, global_loss

    return evaluate


def eval_args(state: TrainingState, layout: StepLayout, inputs: list[torch.Tensor], targets: torch.Tensor) -> tuple[list[torch.Tensor], list[dict]]:
    """The eval program's flat inputs for one rank (traced on shard 0's shapes, as the training
    step is) and what each one is: parameters, buffers, the batch."""
    params = rank_state(state, layout).params
    args = [*(p.detach() for p in params.values()), *(b.detach().clone() for b in state.buffers.values()), *inputs, targets]
    slots = [
        *(_slot("param", name=n) for n in state.params),
        *(_slot("buffer", name=n) for n in state.buffers),
        *(_slot("input", t, index=i) for i, t in enumerate(inputs)),
        _slot("target", targets),
    ]
    return args, slots


def _capture_eval(
    mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout, tp: TensorParallel | None, tracer=None
) -> CapturedStep:
    evaluate = eval_program(mf, state, len(inputs), layout, tp)
    args, slots = eval_args(state, layout, inputs, targets)
    model = state.model if tp is None else tp.model
    contexts = (eval_mode(model), torch.no_grad(), experts_of(model, layout))
    graph = trace_user_code(evaluate, args, mf, "the eval step (forward and loss in eval mode)", *contexts, tracer=tracer)
    return CapturedStep(graph=graph, slots=slots, example_args=list(args))


def capture_eval(mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout) -> CapturedStep:
    """The eval program of one rank of `layout` (one serves every rank, as the training program
    does; under tp traced as the first and last tp rank, a difference refused)."""
    if layout.tp is None:
        return _capture_eval(mf, state, inputs, targets, layout, None)
    return _capture_tp(mf, state, inputs, targets, layout, True, None, capture=_capture_eval)


def capture_pipeline_eval(mf: ModelFile, state: TrainingState, pipeline, layout: StepLayout, inputs: list[torch.Tensor], targets: torch.Tensor) -> CapturedStep:
    """The eval program of one pipeline rank: its stages' forwards (`pipeline.stages`, cut from
    a forward traced in eval mode), every microbatch in order through every stage it holds
    (GPipe's forward: sends do not wait, so no rank waits on one that waits on it), the last
    stage's loss summed over microbatches and shared over the pipeline group, then averaged over
    the data-parallel ranks, as the training step reports it."""
    from aot.capture.pipeline import forward_action, stage_state, transfers

    held = pipeline.held
    own = stage_state(state, [n for n in state.params if any(n in s.params for s in held)], [n for n in state.buffers if any(n in s.buffers for s in held)])
    layout = replace(layout, pp=pipeline.group)
    param_names, buffer_names = list(own.params), list(own.buffers)
    n_params, n_buffers, n_inputs = len(param_names), len(buffer_names), len(inputs)
    local_shapes = layout.local_shapes(own)
    stages = {s.index: s for s in pipeline.stages}
    last, m = len(pipeline.stages) - 1, pipeline.microbatches

    def evaluate(*flat):
        by_name = dict(zip(param_names, flat[:n_params]))
        buffers = dict(zip(buffer_names, flat[n_params : n_params + n_buffers]))
        batch_inputs, batch_targets = flat[-1 - n_inputs : -1], flat[-1]
        used = by_name if layout.fsdp is None else {n: gather_shard(p, local_shapes[n], layout.fsdp, layout.precision) for n, p in by_name.items()}
        batch = (used, buffers, batch_inputs, batch_targets, batch_targets.shape[0] // m)
        receive, send, sent = transfers(pipeline)
        loss_sum = torch.zeros((), dtype=torch.float32)  # not from the targets: a middle stage reads no batch tensor
        for mb in range(m):
            for s in held:
                outputs, _ = forward_action(s, mb, stages, batch, receive, send, grad=False)
                if s.index == last:
                    loss_sum = loss_sum + outputs[0].detach().float()
        for handle in sent:
            _funcol.wait_tensor(handle)
        local_loss = _funcol.wait_tensor(_funcol.all_reduce((loss_sum / m).reshape(1), "sum", pipeline.group.name))[0]
        global_loss = local_loss
        for group in (layout.fsdp, layout.dp):
            if group is not None:
                global_loss = average(global_loss, group)
        return local_loss, global_loss

    args, slots = eval_args(own, replace(layout, pp=None), inputs, targets)
    graph = trace_user_code(evaluate, args, mf, f"pipeline rank {pipeline.rank}'s eval step", torch.no_grad())
    return CapturedStep(graph=graph, slots=slots, example_args=list(args))

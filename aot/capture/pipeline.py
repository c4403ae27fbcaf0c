"""Pipeline parallelism at capture: each pipeline rank's whole step, its schedule unrolled into
one graph, from the stages aot/capture/stages.py cut.

`capture_pipeline` traces the step of one pipeline rank (the stages it holds) with make_fx: the
schedule's actions in order, each a stage forward of one microbatch (its inputs received with
`irecv`, its outputs sent with `isend`: graph nodes, _c10d_functional) or its backward
(`torch.autograd.grad` from the received output gradients, the input gradients sent back). Then
the gradients summed over microbatches are reduced and the optimizer steps, as in the
single-stage step (aot/capture/step.py's `finish`).

Under zero-bubble a backward is two actions: "B" differentiates with respect to the stage's
received inputs only (what the previous stage waits for), keeping autograd's graph, and "W",
later, with respect to its weights. The second `autograd.grad` records again the gradients of the
activations between them; its nodes are tagged (WEIGHT_GRADIENT), and the graph pass
aot/passes/repeated_backward.py merges those into the first's, so a W adds only the
weight-gradient ops.

The loss is the mean over microbatches (each microbatch's loss is divided by their number, as
torch.distributed.pipelining scales it), so a step equals one eager step over the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.fx.traceback as fx_traceback

from aot.capture.group_collectives import gather_shard
from aot.capture.model_file import ModelFile
from aot.capture.stages import MOE_CAPACITY, Stage
from aot.capture.step import (
    CapturedStep,
    Group,
    StepLayout,
    dropped_over_ranks,
    partial_gradients,
    prove,
    rank_state,
    step_args,
    step_program,
    trace_user_code,
)
from aot.capture.training_state import TrainingState
from runner.format.transfers import transfer_tag

_funcol = torch.ops._c10d_functional
WEIGHT_GRADIENT = "aot_weight_gradient"  # node.meta["custom"] key of zero-bubble's weight-gradient ops


# -- one pipeline rank's step ---------------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline:
    """The pipeline a rank's program runs: `pp` ranks over group `group`, `stages` in all (v per
    rank, stage c * pp + r on rank r), `microbatches` per step and the rank's `actions`
    (aot.plan.pipeline.Action: kind "F", "B" or "W", microbatch, chunk). `recompute`: each stage's
    forward keeps only its inputs and runs again in its backward (see `recompute_stages`)."""

    group: Group
    rank: int
    stages: tuple
    microbatches: int
    actions: tuple
    recompute: bool = False

    @property
    def held(self) -> list:
        return [s for s in self.stages if s.index % self.group.size == self.rank]

    @property
    def counts_dropped(self) -> bool:
        """Whether the forward returns an expert capacity's dropped-choice count, the last stage's
        second output (aot/capture/stages.py `cut`)."""
        return len(self.stages[-1].outputs) > 1

    def peer(self, stage: int) -> int:
        """The rank, within the pipeline group, that runs `stage`."""
        return stage % self.group.size


def stage_state(state: TrainingState, params: list[str], buffers: list[str]) -> TrainingState:
    """The training state restricted to one pipeline rank's parameters and buffers."""
    keep = set(params)
    groups = [[n for n in g if n in keep] for g in state.param_groups]
    kept_groups = [i for i, g in enumerate(groups) if g]
    return replace(
        state,
        params={n: p for n, p in state.params.items() if n in keep},
        buffers={n: b for n, b in state.buffers.items() if n in set(buffers)},
        optimizer_slots=[(n, k) for n, k in state.optimizer_slots if n in keep],
        param_groups=[groups[i] for i in kept_groups],
        group_settings=[state.group_settings[i] for i in kept_groups],
        lr_schedule=[[row[i] for i in kept_groups] for row in state.lr_schedule],
    )


def tied_params(stages: list[Stage], pp: int) -> list[str]:
    """Parameters more than one pipeline rank holds (a tied embedding and output layer)."""
    holders: dict = {}
    for s in stages:
        for name in s.params:
            holders.setdefault(name, set()).add(s.index % pp)
    return [n for n, ranks in holders.items() if len(ranks) > 1]


def capture_pipeline(
    mf: ModelFile, state: TrainingState, pipeline: Pipeline, layout: StepLayout, inputs: list[torch.Tensor], targets: torch.Tensor
) -> CapturedStep:
    """The step of one pipeline rank as one graph (its stages' parameters, buffers and optimizer
    state, the learning rates, the rank's whole batch)."""
    held = pipeline.held
    names = [n for n in state.params if any(n in s.params for s in held)]
    buffer_names = [n for n in state.buffers if any(n in s.buffers for s in held)]
    own = stage_state(state, names, buffer_names)
    tied = tied_params(list(pipeline.stages), pipeline.group.size)
    first_holder = {n: min(s.index % pipeline.group.size for s in pipeline.stages if n in s.params) for n in tied}
    # the global norm counts a tied weight once: on the first rank holding it
    uncounted = tuple(n for n in names if n in tied and first_holder[n] != pipeline.rank)
    layout = replace(layout, pp=pipeline.group, pp_uncounted=uncounted)
    _, finish = step_program(mf, own, len(inputs), layout, None)
    args, slots = step_args(own, layout, inputs, targets)
    kept = [i for i, g in enumerate(state.param_groups) if any(n in names for n in g)]
    slots = [{**slot, "group": kept[slot["group"]]} if slot["kind"] == "lr" else slot for slot in slots]
    # what a rank's gradient of each tied weight looks like (its fsdp shard), for ranks without it
    tied_like = {n: t for n, t in rank_state(stage_state(state, tied, []), layout).params.items()}
    step = _pipeline_step(own, pipeline, layout, len(inputs), finish, tied_like)
    # zero-bubble's weight passes are tagged through the node metadata torch keeps while tracing
    split = any(a.kind == "W" for a in pipeline.actions)
    graph = trace_user_code(step, args, mf, f"pipeline rank {pipeline.rank}'s step", fx_traceback.preserve_node_meta() if split else contextlib.nullcontext())
    capacity = pipeline.stages[-1].module.meta.get(MOE_CAPACITY)
    counted = ["moe_dropped"] if pipeline.counts_dropped else []
    outputs = ("loss", "global_loss", *(["found_inf"] if layout.precision.scaler else []), *counted)
    example = [a.detach() for a in args]
    captured = CapturedStep(graph=graph, slots=slots, example_args=example, tp_summed=layout.tp_summed, outputs=outputs, ep_capacity=capacity)
    if layout.tp is not None:
        summed = partial_gradients(captured, layout, state, f"{mf.path.name} (pipeline rank {pipeline.rank})")
        if summed:  # again, with those gradients summed over tp (as capture_step does)
            return capture_pipeline(mf, state, pipeline, replace(layout, tp_summed=summed), inputs, targets)
    prove(captured, layout, state, f"{mf.path.name} (pipeline rank {pipeline.rank}): ")
    return captured


def run_stage(module: torch.fx.GraphModule, values: list, recompute: bool):
    """A stage's forward of one microbatch. Recomputing, it runs under torch.utils.checkpoint:
    autograd keeps the stage's inputs only, and the trace records the forward again inside the
    stage's backward action, where its activations are needed. Between a microbatch's forward and
    its backward (1F1B holds up to pp microbatches in flight) the rank then holds their inputs,
    not their activations: GPipe's recomputation."""
    if not recompute:
        return module(*values)
    from torch.utils.checkpoint import checkpoint

    # preserve_rng_state would restore the generator outside the graph; stages that draw random
    # numbers are refused before tracing (draws_random)
    return checkpoint(module, *values, use_reentrant=False, preserve_rng_state=False)


def draws_random(module: torch.fx.GraphModule) -> str | None:
    """The first op of a stage that draws random numbers (dropout), or None."""
    for node in module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            return str(node.target.overloadpacket.__name__)
    return None


def transfers(pipeline: Pipeline) -> tuple:
    """(receive, send, sent) of one step of a pipeline rank: `receive(shape, dtype, peer stage,
    tag)` and `send(tensor, peer stage, tag)` as graph nodes (irecv, isend), or handed over in
    place between two stages of this rank; `sent`: the sends' handles, each waited on before the
    step ends."""
    pp, group, rank = pipeline.group.size, pipeline.group.name, pipeline.rank
    local: dict = {}  # transfers between stages on this rank: (tag) -> tensor
    sent: list = []

    def receive(like_shape, dtype, peer_stage, t):
        if peer_stage % pp == rank:
            return local.pop(t)
        buffer = torch.empty(like_shape, dtype=dtype)
        return _funcol.wait_tensor(_funcol.irecv(buffer, pipeline.peer(peer_stage), t, group))

    def send(tensor, peer_stage, t):
        if peer_stage % pp == rank:
            local[t] = tensor
        else:
            sent.append(_funcol.isend(tensor.contiguous(), pipeline.peer(peer_stage), t, group))

    return receive, send, sent


def forward_action(s: Stage, mb: int, stages: dict, batch: tuple, receive, send, recompute: bool = False, grad: bool = True) -> tuple:
    """(outputs, received leaves) of stage `s`'s forward of microbatch `mb`: its inputs gathered
    (`batch`: the leaves (parameters as used), buffers, the rank's inputs and targets, the
    microbatch size; other stages' outputs received), run, its outputs sent to their readers.
    `grad`: the received values that carry a gradient become leaves to differentiate."""
    leaves, buffers, batch_inputs, batch_targets, size = batch
    values, received = [], []
    for source in s.sources:
        if source.kind == "param":
            values.append(leaves[source.name])
        elif source.kind == "buffer":
            values.append(buffers[source.name])
        elif source.kind == "input":
            values.append(batch_inputs[source.index][mb * size : (mb + 1) * size])
        elif source.kind == "target":
            values.append(batch_targets[mb * size : (mb + 1) * size])
        else:
            shape, dtype, carries = stages[source.stage].outputs[source.index]
            x = receive(shape, dtype, source.stage, transfer_tag(mb, source.stage, s.index, source.index, False))
            if carries and grad:
                x = x.detach().requires_grad_()
                received.append((source, x))
            values.append(x)
    outputs = run_stage(s.module, values, recompute)
    for j, readers in enumerate(s.readers):
        for reader in readers:
            send(outputs[j].detach(), reader, transfer_tag(mb, s.index, reader, j, False))
    return outputs, received


DROPPED_PART = 2**20  # a count's low part, below float32's exact integers (2**24) as is its high part up to 2**44


def _pipeline_step(own: TrainingState, pipeline: Pipeline, layout: StepLayout, n_inputs: int, finish, tied: dict):
    from runner.format.artifact import SCALER_KEYS
    from aot.capture.loss_scaling import LossScaling

    param_names, buffer_names = list(own.params), list(own.buffers)
    n_params, n_buffers, n_state, n_groups = len(param_names), len(buffer_names), len(own.optimizer_slots), len(own.param_groups)
    precision = layout.precision
    n_scaler = len(SCALER_KEYS) if precision.scaler else 0
    local_shapes = layout.local_shapes(own)
    pp, group, rank, m = pipeline.group.size, pipeline.group.name, pipeline.rank, pipeline.microbatches
    stages = {s.index: s for s in pipeline.stages}
    last = len(pipeline.stages) - 1
    counting = pipeline.counts_dropped
    split = any(a.kind == "W" for a in pipeline.actions)  # zero-bubble: weight gradients apart

    def step(*flat):
        params = list(flat[:n_params])
        buffers = dict(zip(buffer_names, flat[n_params : n_params + n_buffers]))
        opt_state = flat[n_params + n_buffers : n_params + n_buffers + n_state]
        at = n_params + n_buffers + n_state
        lrs = flat[at : at + n_groups]
        scaling = LossScaling(precision.scaler, *flat[at + n_groups : at + n_groups + n_scaler]) if precision.scaler else None
        batch_inputs, batch_targets = flat[-1 - n_inputs : -1], flat[-1]
        size = batch_targets.shape[0] // m
        by_name = dict(zip(param_names, params))
        if layout.fsdp is not None:  # gathered once per step; the gradients are reduce-scattered once, after all microbatches
            gathered = {n: gather_shard(p, local_shapes[n], layout.fsdp, precision) for n, p in by_name.items()}
            leaves = {n: g.detach().requires_grad_() for n, g in gathered.items()}
        else:
            leaves = by_name
        sums: dict = {}
        saved: dict = {}  # (microbatch, stage) -> (outputs, received leaves)
        deferred: dict = {}  # zero-bubble: (microbatch, stage) -> (roots, seeds) of its backward, for its W
        receive, send, sent = transfers(pipeline)
        loss_sum = torch.zeros((), dtype=torch.float32)  # not from the targets: a middle stage reads no batch tensor
        dropped_sum = torch.zeros((), dtype=torch.int64)  # an expert capacity's dropped choices, counted in the last stage

        for action in pipeline.actions:
            s = stages[action.stage(rank, pp)]
            mb = action.microbatch
            if action.kind == "F":
                outputs, received = forward_action(s, mb, stages, (leaves, buffers, batch_inputs, batch_targets, size), receive, send, pipeline.recompute)
                if s.index == last:
                    loss_sum = loss_sum + outputs[0].detach().float()
                    if counting:
                        dropped_sum = dropped_sum + outputs[1]
                saved[(mb, s.index)] = (outputs, received)
            elif action.kind == "W":
                roots, seeds = deferred.pop((mb, s.index))
                wrt_params = [n for n in s.params if n in leaves and leaves[n].requires_grad]
                if roots and wrt_params:
                    with fx_traceback.annotate({WEIGHT_GRADIENT: True}):
                        weight_grads = torch.autograd.grad(roots, [leaves[n] for n in wrt_params], seeds, allow_unused=True)
                    for n, g in zip(wrt_params, weight_grads):
                        if g is not None:
                            sums[n] = g if n not in sums else sums[n] + g
            else:
                outputs, received = saved.pop((mb, s.index))
                if s.index == last:
                    loss = outputs[0] / m
                    roots, seeds = [scaling.scaled(loss) if scaling else loss], None
                else:
                    roots, seeds = [], []
                    for j, readers in enumerate(s.readers):
                        if not readers or not s.outputs[j][2]:
                            continue
                        shape, dtype, _ = s.outputs[j]
                        incoming = [receive(shape, dtype, r, transfer_tag(mb, s.index, r, j, True)) for r in readers]
                        roots.append(outputs[j])
                        seeds.append(sum(incoming[1:], incoming[0]))
                wrt_params = [] if split else [n for n in s.params if n in leaves and leaves[n].requires_grad]
                wrt = [leaves[n] for n in wrt_params] + [x for _, x in received]
                # zero-bubble keeps autograd's graph for the W that differentiates it again
                grads: list = list(torch.autograd.grad(roots, wrt, seeds, allow_unused=True, retain_graph=split)) if roots and wrt else [None] * len(wrt)
                if split:
                    deferred[(mb, s.index)] = (roots, seeds)
                for n, g in zip(wrt_params, grads):
                    if g is not None:
                        sums[n] = g if n not in sums else sums[n] + g
                for (source, x), g in zip(received, grads[len(wrt_params) :]):
                    send(g if g is not None else torch.zeros_like(x), source.stage, transfer_tag(mb, source.stage, s.index, source.index, True))
        for handle in sent:  # every send done before the step ends
            _funcol.wait_tensor(handle)
        if layout.fsdp is not None:
            present = [n for n in param_names if n in sums]
            reduced = torch.autograd.grad([gathered[n] for n in present], [by_name[n] for n in present], [sums[n] for n in present])
            sums = dict(zip(present, reduced))
        # One all_reduce over the pipeline group (the same on every rank, whatever a pass could
        # reorder): the last stage's loss for every rank, and the gradients of weights two ranks
        # hold (a tied embedding and output layer) summed, as Megatron does.
        pieces = [(loss_sum / m).reshape(1)]
        if counting:  # the dropped count rides along, exact as two float32 parts (a separate all_reduce, its
            # input made at the start on the other ranks, was issued there first: out of order with the p2p)
            pieces.append(torch.stack([dropped_sum // DROPPED_PART, dropped_sum % DROPPED_PART]).float())
        for name, like in tied.items():
            mine = sums.get(name)
            pieces.append(
                (mine if mine is not None else torch.zeros(like.shape, dtype=like.dtype)).reshape(-1).float()
            )  # made in the graph: `like` is no input of it
        total = _funcol.wait_tensor(_funcol.all_reduce(torch.cat(pieces), "sum", group))
        local_loss = total[0]
        at = 3 if counting else 1
        for name, like in tied.items():
            if name in by_name:
                sums[name] = total[at : at + like.numel()].reshape(like.shape).to(like.dtype)
            at += like.numel()
        grads = [sums.get(n) for n in param_names]
        finished = finish(params, grads, local_loss, opt_state, lrs, scaling)
        if not counting:
            return finished
        dropped = total[1].round().long() * DROPPED_PART + total[2].round().long()
        return (*finished, dropped_over_ranks(dropped, layout))

    return step

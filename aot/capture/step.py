"""Capture of the whole training step as one FX graph.

The step is a plain function of (parameters, buffers, optimizer state, learning rates, inputs,
targets): forward through `torch.func.functional_call`, the user's loss, `torch.autograd.grad`,
the gradient reduction the plan asks for (functional collectives, so they are graph nodes),
clipping as `clip_grad_norm_` does it, and the user's own torch.optim optimizer stepping on the
traced tensors. make_fx traces it on fake tensors, so no real computation or collective runs and
any world size can be built on one machine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aot.capture.model_file import ModelFile, call_user
from aot.capture.training_state import TrainingState
from aot.errors import AotError
from runner.checkpoint import optimizer_key
from runner.data import dtype_name
from runner.sharding import shard

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class Group:
    """A process group as the graph names it, and how many ranks it has."""
    name: str
    size: int


@dataclass(frozen=True)
class StepLayout:
    """How the plan distributes the step: gradients (and the reported loss) are averaged over
    `dp` (replicas) and `fsdp` (shards); with `fsdp`, every parameter and its optimizer state
    arrive as this rank's flat-padded shard and are all-gathered for use."""
    dp: Group | None = None
    fsdp: Group | None = None


@dataclass
class CapturedStep:
    graph: torch.fx.GraphModule
    slots: list[dict]              # what each graph input is, in order (the manifest's "inputs")
    example_args: list[torch.Tensor]


def _average(t: torch.Tensor, group: Group) -> torch.Tensor:
    summed = _funcol.wait_tensor(_funcol.all_reduce(t, "sum", group.name))
    return summed / group.size


def _gather(piece: torch.Tensor, full: torch.Tensor, group: Group) -> torch.Tensor:
    """The whole parameter from this rank's shard. The autograd variant of all_gather makes
    backward reduce-scatter the gradient, so it arrives summed over the group and sharded."""
    gathered = _funcol.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(piece, group.size, group.name))
    return gathered[: full.numel()].view(full.shape)


def _clip_sharded(shards: list[torch.Tensor], max_norm: float, group: Group) -> None:
    """clip_grad_norm_ for gradients sharded over `group`: the same global norm (the square root
    of the sum of squares of every element), summed across the shards first."""
    squares = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in shards]).sum()
    total = torch.sqrt(_funcol.wait_tensor(_funcol.all_reduce(squares, "sum", group.name)))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(shards, coef)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensor logs a full traceback when an op's shape check fails; the user gets one line
    from us instead (and the traceback with --debug, which re-raises)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def _optimizer_tracing():
    """torch.optim keeps step counters as tensors (instead of calling .item()) when it believes
    it is being compiled, which is what a static graph needs; torch.compile sets the same flag."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


def _slot(kind: str, tensor: torch.Tensor | None = None, **fields) -> dict:
    slot = {"kind": kind, **fields}
    if kind in ("input", "target"):
        slot.update(shape=list(tensor.shape), dtype=dtype_name(tensor.dtype))
    return slot


def capture_step(mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor,
                 layout: StepLayout) -> CapturedStep:
    param_names, buffer_names = list(state.params), list(state.buffers)
    n_params, n_buffers = len(param_names), len(buffer_names)
    n_state, n_groups = len(state.optimizer_slots), len(state.param_groups)

    def step(*flat):
        params = list(flat[:n_params])
        buffers = flat[n_params:n_params + n_buffers]
        opt_state = flat[n_params + n_buffers:n_params + n_buffers + n_state]
        lrs = flat[n_params + n_buffers + n_state:n_params + n_buffers + n_state + n_groups]
        batch_inputs, batch_targets = flat[-1 - len(inputs):-1], flat[-1]
        by_name = dict(zip(param_names, params))

        if layout.fsdp is not None:
            used = {n: _gather(p, state.params[n], layout.fsdp) for n, p in by_name.items()}
        else:
            used = by_name
        tensors = {**used, **dict(zip(buffer_names, buffers))}
        outputs = torch.func.functional_call(state.model, tensors, tuple(batch_inputs))
        loss = call_user(mf.loss, "loss(outputs, targets)", mf.path, outputs, batch_targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AotError(f"{mf.path.name}: loss(outputs, targets) must return a scalar tensor")
        # Detached before backward so its reduction can join the first gradient bucket.
        local_loss = loss.detach()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        global_loss = local_loss
        if layout.fsdp is not None:  # already summed over the shard group by the reduce-scatter
            grads = [None if g is None else g / layout.fsdp.size for g in grads]
            global_loss = _average(global_loss, layout.fsdp)
        if layout.dp is not None:
            grads = [None if g is None else _average(g, layout.dp) for g in grads]
            global_loss = _average(global_loss, layout.dp)

        optimizer = call_user(mf.optimizer, "optimizer(params)", mf.path, params)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for (name, key), value in zip(state.optimizer_slots, opt_state):
            optimizer.state[by_name[name]][key] = value
        for p, g in zip(params, grads):
            p.grad = g
        if mf.max_grad_norm is not None and layout.fsdp is not None:
            _clip_sharded([p.grad for p in params if p.grad is not None], mf.max_grad_norm, layout.fsdp)
        elif mf.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, mf.max_grad_norm)
        optimizer.step()
        return local_loss, global_loss

    lr_args = [torch.tensor(v, dtype=torch.float64) for v in state.lr_schedule[0]]
    # Traced on shard 0's shapes: every rank's shard has the same shape, so one program serves all.
    local = rank_state(state, layout, 0)
    args = [
        *(p.requires_grad_(True) for p in local.params.values()),
        *(b.detach().clone() for b in state.buffers.values()),
        *(local.optimizer_state[f"{n}:{k}"].clone() for n, k in state.optimizer_slots),
        *lr_args, *inputs, targets,
    ]
    slots = [
        *(_slot("param", name=n) for n in param_names),
        *(_slot("buffer", name=n) for n in buffer_names),
        *(_slot("optim", name=n, key=k) for n, k in state.optimizer_slots),
        *(_slot("lr", group=i) for i in range(n_groups)),
        *(_slot("input", t, index=i) for i, t in enumerate(inputs)),
        _slot("target", targets),
    ]
    try:
        with _optimizer_tracing(), _quiet_fake_tensor_log():
            graph = make_fx(step, tracing_mode="fake")(*args)
    except AotError:
        raise
    except Exception as e:
        raise AotError(f"{mf.path.name}: the training step cannot be traced: {_describe_trace_error(e, mf)}") from e
    # Export re-traces the graph with in-place updates on these inputs; they must not require grad.
    example = [a.detach() for a in args]
    return CapturedStep(graph=graph, slots=slots, example_args=example)


@dataclass
class RankState:
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]


def rank_state(state: TrainingState, layout: StepLayout, shard_index: int) -> RankState:
    """The parameters and optimizer state one rank holds: everything, or its fsdp shard of every
    tensor shaped like its parameter (0-dim state such as step counters is replicated)."""
    if layout.fsdp is None:
        return RankState({n: p.detach().clone() for n, p in state.params.items()},
                         {k: v.clone() for k, v in state.optimizer_state.items()})
    parts = layout.fsdp.size
    params = {n: shard(p, parts, shard_index) for n, p in state.params.items()}
    optimizer_state = {}
    for name, key in state.optimizer_slots:
        value = state.optimizer_state[optimizer_key(name, key)]
        if value.dim() == 0:
            optimizer_state[optimizer_key(name, key)] = value.clone()
        elif value.shape == state.params[name].shape:
            optimizer_state[optimizer_key(name, key)] = shard(value, parts, shard_index)
        else:
            raise AotError(f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, unlike its parameter; "
                           f"it cannot be sharded with fsdp")
    return RankState(params, optimizer_state)


def _describe_trace_error(e: Exception, mf: ModelFile) -> str:
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(mf.path)]
    where = f" at {mf.path.name}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {message}{where}"

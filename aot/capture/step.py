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
from runner.data import dtype_name

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class GradientReduction:
    """Average gradients (and the reported loss) over one process group of `size` ranks."""
    group: str
    size: int


@dataclass
class CapturedStep:
    graph: torch.fx.GraphModule
    slots: list[dict]              # what each graph input is, in order (the manifest's "inputs")
    example_args: list[torch.Tensor]


def _average(t: torch.Tensor, reduction: GradientReduction) -> torch.Tensor:
    summed = _funcol.wait_tensor(_funcol.all_reduce(t, "sum", reduction.group))
    return summed / reduction.size


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
                 reduction: GradientReduction | None) -> CapturedStep:
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

        tensors = {**by_name, **dict(zip(buffer_names, buffers))}
        outputs = torch.func.functional_call(state.model, tensors, tuple(batch_inputs))
        loss = call_user(mf.loss, "loss(outputs, targets)", mf.path, outputs, batch_targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AotError(f"{mf.path.name}: loss(outputs, targets) must return a scalar tensor")
        # Detached before backward so its reduction can join the first gradient bucket.
        local_loss = loss.detach()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        global_loss = local_loss
        if reduction is not None:
            grads = [None if g is None else _average(g, reduction) for g in grads]
            global_loss = _average(local_loss, reduction)

        optimizer = call_user(mf.optimizer, "optimizer(params)", mf.path, params)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for (name, key), value in zip(state.optimizer_slots, opt_state):
            optimizer.state[by_name[name]][key] = value
        for p, g in zip(params, grads):
            p.grad = g
        if mf.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, mf.max_grad_norm)
        optimizer.step()
        return local_loss, global_loss

    lr_args = [torch.tensor(v, dtype=torch.float64) for v in state.lr_schedule[0]]
    args = [
        *(p.detach().clone().requires_grad_(True) for p in state.params.values()),
        *(b.detach().clone() for b in state.buffers.values()),
        *(state.optimizer_state[f"{n}:{k}"].clone() for n, k in state.optimizer_slots),
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


def _describe_trace_error(e: Exception, mf: ModelFile) -> str:
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(mf.path)]
    where = f" at {mf.path.name}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {message}{where}"

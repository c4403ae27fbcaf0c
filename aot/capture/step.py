"""Capture of the whole training step as one FX graph.

The step is a plain function of (parameters, buffers, optimizer state, learning rates, inputs,
targets): forward through `torch.func.functional_call`, the user's loss, `torch.autograd.grad`,
the gradient reduction the plan asks for (functional collectives, so they are graph nodes),
clipping as `clip_grad_norm_` does it, and the user's own torch.optim optimizer stepping on the
traced tensors. make_fx traces it on fake tensors, so no real computation or collective runs and
any world size can be built on one machine.

`capture_step(tracer=...)` takes another tracer with make_fx's contract: the planner, which only
prices a graph, passes aot/plan/pricing.py's (the same graph, recorded in about half the time).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx

from aot.capture import replicas
from aot.capture.expert_parallel import Dispatches, ExpertLayer, experts_in_graph
from aot.capture.fused_attention import FusedAttention
from aot.capture.group_collectives import Group, average, gather_shard, sum_over, sum_over_groups
from aot.capture.inert_calls import drop_inert_calls
from aot.capture.loss_scaling import LossScaling
from aot.capture.model_file import ModelFile, call_user, describe_error
from aot.capture.static_shapes import refuse_data_dependent_shapes
from aot.capture.module_calls import annotate_module_calls
from aot.capture.precision import Precision
from aot.capture.sync_batchnorm import sync_batchnorm_in_graph
from aot.capture.target_autocast import TargetAutocast
from aot.capture.tensor_parallel import TensorParallel, rename_group, tensor_parallel, transposed_linear
from aot.capture.trace_logs import quiet_trace_logs
from aot.capture.training_state import TrainingState
from aot.errors import AotError
from runner.format.checkpoint import optimizer_key
from runner.execution.data import dtype_name
from runner.format.artifact import SCALER_KEYS
from runner.execution.init_program import initial_scaler_state
from runner.format.sharding import expert_slice, shard, tp_slice, tp_slice_shape, tp_style
from runner.format.axes import EP, TP

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class StepLayout:
    """How the plan distributes the step: gradients (and the reported loss) are averaged over
    `dp` (replicas) and `fsdp` (shards); with `fsdp`, every parameter and its optimizer state
    arrive as this rank's flat-padded shard and are all-gathered for use. With `tp`, the Linear
    layers `tp_plan` names (module -> "colwise" | "rowwise" | "colwise:K") hold a slice of their weights, and
    fsdp shards that slice."""

    dp: Group | None = None
    fsdp: Group | None = None
    tp: Group | None = None
    tp_plan: tuple[tuple[str, str], ...] = ()
    sequence: dict | None = None  # sequence parallelism (aot.plan.sequence_parallel.sequence_parallel_layout)
    # The dtypes the step computes and reduces in (aot/capture/precision.py): part of the layout
    # because it changes what each collective carries, which the planner prices.
    precision: Precision = Precision()
    # Pipeline parallelism (aot/capture/pipeline.py): the group of the rank's pipeline, and the
    # parameters whose gradients this rank leaves out of the global norm (a tied weight's copy,
    # counted on the first rank holding it)
    pp: Group | None = None
    pp_uncounted: tuple[str, ...] = ()
    # Whole (not split) parameters whose gradient each tp rank holds a part of, summed over tp
    # before anything reads it (aot/capture/replicas.py finds them; a tp_plan entry
    # "replicated_with_grad_allreduce" names them)
    tp_summed: tuple[str, ...] = ()
    # Expert parallelism (aot/capture/expert_parallel.py): the ep group, the experts modules it
    # splits, and their weights, which each ep rank holds E/ep of (a slice along dimension 0)
    ep: Group | None = None
    ep_layers: tuple[ExpertLayer, ...] = ()
    ep_capacity_factor: float | None = None  # None: dropless (every token an expert is routed)

    @property
    def ep_params(self) -> tuple[str, ...]:
        return tuple(name for layer in self.ep_layers for name in layer.params()) if self.ep is not None else ()

    def tp_dims(self, state: TrainingState) -> dict[str, int]:
        """Parameter name -> the dimension tensor parallelism splits it along (torch's
        ColwiseParallel splits weight and bias along the output features, RowwiseParallel the
        weight along the input features and keeps the bias whole; transformers' Conv1D stores its
        weight (in, out), so there the weight's dimensions swap)."""
        return {name: dim for name, (dim, _fused) in self._tp_split(state).items()}

    def tp_fused(self, state: TrainingState) -> dict[str, int]:
        """Parameter name -> K for the parameters of fused column-wise layers ("colwise:K"), whose
        split dimension holds K equal parts (runner.format.sharding.tp_slice)."""
        return {name: fused for name, (_dim, fused) in self._tp_split(state).items() if fused > 1}

    def _tp_split(self, state: TrainingState) -> dict[str, tuple[int, int]]:
        if self.tp is None:
            return {}
        modules = dict(state.model.named_modules())
        split = {}
        for module, style in self.tp_plan:
            kind, fused = tp_style(style)
            out_dim = 1 if transposed_linear(modules.get(module)) else 0
            entries = {"weight": out_dim, "bias": 0} if kind == "colwise" else {"weight": 1 - out_dim}
            for leaf, dim in entries.items():
                name = f"{module}.{leaf}"
                if name in state.aliases or any(v == name for v in state.aliases.values()):
                    raise AotError(f"tensor parallel: {name} is tied to another parameter; a tied weight cannot be split (leave {module!r} out of tp_plan)")
                if name in state.params:
                    split[name] = (dim, fused)
        return split

    def local_shapes(self, state: TrainingState) -> dict[str, torch.Size]:
        """Every parameter's shape on one rank before fsdp sharding (its tensor-parallel slice)."""
        dims, parts = self.tp_dims(state), self.tp.size if self.tp else 1
        dims.update({name: 0 for name in self.ep_params})  # experts are never tp-split (tp_plan names Linear layers)
        sizes = {name: parts for name in dims} | {name: self.ep.size for name in self.ep_params if self.ep is not None}
        return {name: torch.Size(tp_slice_shape(list(p.shape), dims.get(name), sizes.get(name, 1))) for name, p in state.params.items()}


@dataclass
class CapturedStep:
    graph: torch.fx.GraphModule
    slots: list[dict]  # what each graph input is, in order (the manifest's "inputs")
    example_args: list[torch.Tensor]
    # how every mesh axis holds each parameter (aot/capture/replicas.py); the build's captures
    # have it, the planner's pricing traces do not
    replicas: replicas.Proof | None = None
    tp_summed: tuple[str, ...] = ()  # the layout's tp_summed as traced (capture_step adds what it finds)
    outputs: tuple[str, ...] = ("loss", "global_loss")  # the program's outputs, as the manifest names them
    ep_capacity: int | None = None  # expert parallelism: rows each rank sends each expert


def _wide_counter(value: torch.Tensor) -> torch.Tensor:
    """A float32 step counter (torch.optim's `step` state, a 0-dim tensor) as float64 while the
    optimizer runs; other 0-dim state (a scalar parameter's moments) stays as it is. Traced, Adam
    computes its bias corrections from the counter as tensors (`1 - beta2 ** step`), which in
    float32 loses five digits at step 1 (0.999 is not a float32); eager torch.optim on CPU, and on
    GPUs without capturable, computes them from `step.item()` in double precision. In float64 the
    trace computes what eager computes (aot was 3e-6 of loss and 2.6e-8 of mean weight off eager
    on one rank after 5 Adam steps before: tests/test_replicas.py)."""
    return value.double() if value.dim() == 0 and value.dtype == torch.float32 else value


def _store_counters(stored: list[torch.Tensor], used: list[torch.Tensor]) -> None:
    """The widened counters' new values back into the step's own (float32) state."""
    for before, after in zip(stored, used):
        if after is not before:
            before.copy_(after)


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    # one foreach node for all norms, as clip_grad_norm_ computes them
    return torch.stack(torch._foreach_norm(grads)).pow(2).sum()


def _clip_distributed(grads: list[torch.Tensor], split_by: list[str], max_norm: float, layout: StepLayout, counted: list[bool] | None = None) -> None:
    """clip_grad_norm_ for gradients split across ranks: the same global norm (the square root of
    the sum of squares of every element). Slices along an axis (`split_by` "tp": tensor-parallel
    slices, "ep": experts) add up over its group (the replicated gradients are equal on every such
    rank and count once); fsdp shards over the fsdp group; pipeline stages over the pp group
    (`counted` False: a tied copy another stage counts)."""
    counted = counted or [True] * len(grads)
    whole = [g for g, s, c in zip(grads, split_by, counted) if not s and c]
    total = _squares(whole) if whole else grads[0].new_zeros(())
    for axis, group in ((TP, layout.tp), (EP, layout.ep)):
        split = [g for g, s, c in zip(grads, split_by, counted) if s == axis and c]
        if split:
            assert group is not None  # only the axis's own layout splits a gradient along it
            total = total + sum_over(_squares(split), group)
    if layout.fsdp is not None:
        total = sum_over(total, layout.fsdp)
    if layout.pp is not None:
        total = sum_over(total, layout.pp)
    with fx_traceback.annotate({replicas.CLIP_COEFFICIENT: True}):
        coef = torch.clamp(max_norm / (torch.sqrt(total) + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)


@contextlib.contextmanager
def traced_as_compiled():
    """Code that asks `torch.compiler.is_compiling()` takes its torch.compile path, which is what a
    static graph needs: torch.optim keeps step counters as tensors (instead of calling .item()),
    transformers' experts avoid kernels compilers cannot take. Every trace of model code runs
    under it (the step's, a pipeline's forward), so all take the same path; torch.compile sets the
    same flag."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


def _foreach_as_on_gpus(optimizer: torch.optim.Optimizer) -> None:
    """Where the user left `foreach` unset, step as torch.optim does on GPUs: one foreach kernel per
    update over every parameter of a group. On the fake CPU tensors of a trace torch would pick the
    per-parameter loop, a graph about twice as many nodes (slower to trace and to run, the same
    numbers up to rounding). `capturable` keeps the step counters and the traced learning rate as
    tensors, which foreach needs for a tensor learning rate."""
    for group in optimizer.param_groups:
        if "foreach" in optimizer.defaults and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True
            if "capturable" in optimizer.defaults:
                group["capturable"] = True


def _slot(kind: str, tensor: torch.Tensor | None = None, **fields) -> dict:
    slot = {"kind": kind, **fields}
    if kind in ("input", "target"):
        assert tensor is not None  # the batch's slots describe their tensor
        slot.update(shape=list(tensor.shape), dtype=dtype_name(tensor.dtype))
    return slot


def trace_user_code(fn, args: list, mf: ModelFile, what: str, *contexts, tracer=None) -> torch.fx.GraphModule:
    """`fn` (a function of model code) traced on `args` (`tracer`: make_fx on fake tensors unless
    given) as torch.compile would run it (traced_as_compiled), torch's trace logs quiet, under
    `contexts` too; calls that leave nothing in the graph dropped. A failure is one line naming
    `what` and the model file's line."""
    try:
        with contextlib.ExitStack() as stack:
            for context in (traced_as_compiled(), quiet_trace_logs(), *contexts):
                stack.enter_context(context)
            graph = (tracer or fake_make_fx)(fn, args)
        drop_inert_calls(graph)
        refuse_data_dependent_shapes(graph, f"{mf.path.name}: {what}")
    except AotError:
        raise
    except Exception as e:
        cause = e.__context__  # our refusal, which torch's annotation contexts failed to unwind from
        if isinstance(cause, AotError):
            raise cause from None
        raise AotError(f"{mf.path.name}: {what} cannot be traced: {describe_error(e, mf.path)}") from e
    return graph


def fake_make_fx(step, args: list) -> torch.fx.GraphModule:
    """The build's tracer: make_fx on fake tensors (no real computation or collective runs), as a
    lazy graph module: its Python code is generated when something first runs or reads it (the
    export), not after each pass that changes the graph (each such recompile() of a 100,000-node
    step wrote its code anew: two thirds of the passes' time building a 61-layer MoE)."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return make_fx(step, tracing_mode="fake")(*args)


def capture_step(
    mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout, check_ranks: bool = True, tracer=None
) -> CapturedStep:
    """The step's graph for one rank of `layout`. With tensor parallelism one program serves every
    tp rank, so the trace must not depend on the rank: DTensor picks "this rank's" piece by the
    mesh coordinate at trace time wherever a whole tensor becomes a shard. With `check_ranks` (the
    build) the step is traced as tp rank 0 and as the last tp rank and any difference is refused;
    the planner, which only prices the graph, traces once. `tracer(step, args) -> GraphModule`:
    make_fx on fake tensors unless given (see the module docstring)."""
    if layout.tp is None:
        captured = _capture(mf, state, inputs, targets, layout, None, tracer)
    else:
        captured = _capture_tp(mf, state, inputs, targets, layout, check_ranks, tracer)
        summed = partial_gradients(captured, layout, state, mf.path.name)
        if summed:
            # again, with those gradients summed over tp (a trace is cheaper than editing the graph's
            # backward, and the planner, which calls this too, prices the same program)
            layout = replace(layout, tp_summed=summed)
            captured = _capture_tp(mf, state, inputs, targets, layout, check_ranks, tracer)
    captured.tp_summed = layout.tp_summed
    if check_ranks:
        prove(captured, layout, state, f"{mf.path.name}: ")
    return captured


def prove(captured: CapturedStep, layout: StepLayout, state: TrainingState, where: str) -> None:
    """The replica proof of a captured step (aot/capture/replicas.py), kept on it; refuses a
    parameter no axis can account for."""
    captured.replicas = replicas.prove_step(captured.graph.graph, captured.slots, layout, set(layout.tp_dims(state)), where)


def partial_gradients(captured: CapturedStep, layout: StepLayout, state: TrainingState, where: str) -> tuple[str, ...]:
    """The whole parameters, beyond `layout.tp_summed`, whose gradient is a per-tp-rank part
    (aot/capture/replicas.py), with the ones already summed: () when there are none beyond them.
    The ones the model file's tp_plan names are checked to be such."""
    assert layout.tp is not None
    axis = replicas.axes_of(captured.slots, {TP: layout.tp}, set(layout.tp_dims(state)), layout.sequence is not None)[0]
    found = replicas.tp_partial(captured.graph.graph, captured.slots, axis, f"{where}: ", frozenset(layout.tp_summed))
    return tuple(sorted({*layout.tp_summed, *found})) if found else ()


def _capture_tp(
    mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout, check_ranks: bool, tracer, capture=None
) -> CapturedStep:
    """`capture(mf, state, inputs, targets, layout, tp, tracer)` (the training step's `_capture`
    unless given) under tensor parallelism, traced as the first (and with `check_ranks` the last)
    tp rank."""
    assert layout.tp is not None
    capture = capture or _capture
    traced = []
    for rank in (0, layout.tp.size - 1) if check_ranks else (0,):
        with tensor_parallel(state.model, dict(layout.tp_plan), layout.tp.size, layout.tp.name, layout.sequence, rank=rank) as tp:
            expected = layout.tp_dims(state)
            found = {n: d for n, d in tp.dims.items() if n in state.params}
            if found != expected:  # our slicing of the stored state must be torch's
                raise AotError(f"tensor parallel: torch placed {found}, expected {expected}")
            captured = capture(mf, state, inputs, targets, layout, tp, tracer)
            rename_group(captured.graph, tp.mesh.get_group().group_name, layout.tp.name)
        traced.append(captured)
    if check_ranks and traced[0].graph.code != traced[1].graph.code:
        raise AotError(
            "tensor parallel: the traced step differs between tp ranks (a whole tensor is split by rank "
            "inside the model); this plan cannot run as one program, change tp_plan"
        )
    return traced[0]


def step_program(mf: ModelFile, state: TrainingState, n_inputs: int, layout: StepLayout, tp: TensorParallel | None, dispatches: Dispatches | None = None):
    """(step, finish): the training step as a function of its flat inputs (`step_args`), and its
    part once the gradients exist (averaging, clipping, the optimizer) as a function of (params,
    grads, local loss, optimizer state, learning rates[, loss scaling]). The step ends by calling
    `finish`; the planner also traces `finish` alone (derive_without_fsdp). With an ep capacity
    factor the step also returns the choices its experts dropped over every data rank, read from
    `dispatches` (filled while the forward is traced)."""
    param_names, buffer_names = list(state.params), list(state.buffers)
    local_shapes = layout.local_shapes(state)
    full_shapes = {n: p.shape for n, p in state.params.items()}
    tp_split = [n in layout.tp_dims(state) for n in param_names]
    ep_split = [n in layout.ep_params for n in param_names]
    n_params, n_buffers = len(param_names), len(buffer_names)
    n_state, n_groups = len(state.optimizer_slots), len(state.param_groups)
    precision = layout.precision
    n_scaler = len(SCALER_KEYS) if precision.scaler else 0
    reduce_dtype = precision.reduce_dtype if precision.mixed else None

    def finish(params, grads, local_loss, opt_state, lrs, scaling: LossScaling | None = None):
        by_name = dict(zip(param_names, params))
        global_loss = local_loss
        if layout.tp_summed:
            assert layout.tp is not None  # only tensor parallelism leaves a part of a gradient per rank
            summed = set(layout.tp_summed)
            grads = [sum_over(g, layout.tp) if g is not None and n in summed else g for n, g in zip(param_names, grads)]
        if layout.fsdp is not None:  # already summed over the shard group by the reduce-scatter
            grads = [None if g is None else g / layout.fsdp.size for g in grads]
            global_loss = average(global_loss, layout.fsdp)
        if layout.dp is not None:
            grads = [None if g is None else average(g, layout.dp, reduce_dtype) for g in grads]
            global_loss = average(global_loss, layout.dp)
        if layout.ep is not None:
            # an expert's gradient already holds every ep rank's tokens (the reverse all_to_all
            # summed them): divided by the ep ranks, not averaged over them; the rest as under dp
            grads = [None if g is None else g / layout.ep.size if s else average(g, layout.ep, reduce_dtype) for g, s in zip(grads, ep_split)]
            global_loss = average(global_loss, layout.ep)

        optimizer = call_user(mf.optimizer, "optimizer(params)", mf.path, params)
        # optimizer() sees this rank's pieces (flat fsdp shards, tp slices) and may group them by
        # what the pieces show (nanoGPT decays parameters with dim() >= 2): the groups are those it
        # made of the whole parameters (TrainingState), each with its settings
        optimizer.param_groups = [{**settings, "params": [by_name[n] for n in names]} for names, settings in zip(state.param_groups, state.group_settings)]
        _foreach_as_on_gpus(optimizer)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        stored = list(opt_state)
        opt_state = [_wide_counter(v) if key == "step" else v for (_, key), v in zip(state.optimizer_slots, stored)]
        for (name, key), value in zip(state.optimizer_slots, opt_state):
            optimizer.state[by_name[name]][key] = value
        for p, g in zip(params, grads):
            p.grad = g
        found_inf = None
        if scaling is not None:
            held = [p for p in params if p.grad is not None]
            unscaled, found_inf = scaling.unscale([p.grad for p in held])
            for p, g in zip(held, unscaled):
                p.grad = g
            found_inf = _any_rank(found_inf, layout)
        if mf.max_grad_norm is not None and any(g is not None for g in (layout.fsdp, layout.tp, layout.pp, layout.ep)):
            # which axis splits each gradient: tp, ep or none (""), and whether this rank counts it
            split = [(TP if t else EP if e else "", n not in layout.pp_uncounted) for n, t, e in zip(param_names, tp_split, ep_split)]
            present = [(p.grad, s, c) for p, (s, c) in zip(params, split) if p.grad is not None]
            _clip_distributed([g for g, _, _ in present], [s for _, s, _ in present], mf.max_grad_norm, layout, [c for _, _, c in present])
        elif mf.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, mf.max_grad_norm)
        if scaling is None:
            optimizer.step()
            _store_counters(stored, opt_state)
            return local_loss, global_loss
        assert found_inf is not None  # set above with the loss scaling
        scaling.step_unless(found_inf, [*params, *opt_state], optimizer.step)
        _store_counters(stored, opt_state)
        scaling.update(found_inf)
        return local_loss, global_loss, found_inf

    model = state.model if tp is None else tp.model

    def step(*flat):
        params = list(flat[:n_params])
        buffers = flat[n_params : n_params + n_buffers]
        opt_state = flat[n_params + n_buffers : n_params + n_buffers + n_state]
        at = n_params + n_buffers + n_state
        lrs = flat[at : at + n_groups]
        scaling = LossScaling(precision.scaler, *flat[at + n_groups : at + n_groups + n_scaler]) if precision.scaler else None
        batch_inputs, batch_targets = flat[-1 - n_inputs : -1], flat[-1]
        by_name = dict(zip(param_names, params))

        if layout.fsdp is not None:
            used = {n: gather_shard(p, local_shapes[n], layout.fsdp, precision) for n, p in by_name.items()}
        else:
            used = by_name
        if tp is not None:
            used = tp.wrap(used, full_shapes)
        loss = forward_and_loss(mf, model, precision, {**used, **dict(zip(buffer_names, buffers))}, batch_inputs, batch_targets)
        # Detached before backward so its reduction can join the first gradient bucket.
        local_loss = loss.detach()
        grads = torch.autograd.grad(scaling.scaled(loss) if scaling else loss, params, allow_unused=True)
        finished = finish(params, grads, local_loss, opt_state, lrs, scaling)
        if dispatches is None or not dispatches.dropped:
            return finished
        return (*finished, dropped_over_ranks(torch.stack(dispatches.dropped).sum(), layout))

    return step, finish


def forward_and_loss(mf: ModelFile, model: torch.nn.Module, precision: Precision, tensors: dict, batch_inputs, batch_targets) -> torch.Tensor:
    """The model's forward on `tensors` (parameters and buffers by name) and the user's loss, as
    torch.autocast would run them under `precision`: a scalar tensor, or refused."""
    with _autocast_region(precision):
        outputs = torch.func.functional_call(model, tensors, tuple(batch_inputs))
        loss = call_user(mf.loss, "loss(outputs, targets)", mf.path, outputs, batch_targets)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise AotError(f"{mf.path.name}: loss(outputs, targets) must return a scalar tensor")
    return loss


@contextlib.contextmanager
def _autocast_region(precision: Precision):
    """torch.autocast with the target's rules: CPU's directly; another device's (CUDA) applied call
    by call on the step's CPU tensors (aot/capture/target_autocast.py), since autograd cannot run on
    fake CUDA tensors where torch has no CUDA.

    For a target other than the CPU, scaled_dot_product_attention is recorded as the runner's
    fused operator where it can be (aot/capture/fused_attention.py), and otherwise held to its
    math backend: torch picks SDPA's kernel by the tensors' device, which for the build's CPU
    tensors is a fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`) that a GPU has
    no kernel for. The math backend records plain ops every device runs (the build notes the
    scores they keep). The fused mode is entered last, so it sees each call before autocast."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        if precision.rules != "cpu":
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        target_autocast = precision.mixed and precision.rules != "cpu"
        if target_autocast:
            stack.enter_context(TargetAutocast(precision.rules, precision.compute_dtype, precision.autocast))
        else:
            stack.enter_context(precision.autocast())
        if precision.rules != "cpu":
            stack.enter_context(FusedAttention(precision.compute_dtype if target_autocast else None))
        yield


def _any_rank(found_inf: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """found_inf summed over the groups whose ranks hold different gradients (fsdp shards, tp
    slices, pipeline stages), so every rank skips the same steps, as FSDP's ShardedGradScaler
    does. Data-parallel replicas hold the same averaged gradients already, so their checks agree
    without one."""
    return sum_over_groups(found_inf, (layout.fsdp, layout.tp, layout.pp, layout.ep))


def dropped_over_ranks(dropped: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """An expert capacity's dropped-choice count summed over every rank holding other tokens
    (the data axes, and tp, whose ranks dispatch shares of them)."""
    return sum_over_groups(dropped, (layout.fsdp, layout.dp, layout.ep, layout.tp))


def step_args(state: TrainingState, layout: StepLayout, inputs: list[torch.Tensor], targets: torch.Tensor) -> tuple[list[torch.Tensor], list[dict]]:
    """The step's flat inputs for one rank of `layout` (traced on shard 0's shapes: every rank's shard
    has the same shape, so one program serves all) and what each one is (the manifest's "inputs")."""
    precision = layout.precision
    lr_args = [torch.tensor(v, dtype=torch.float64) for v in state.lr_schedule[0]]
    local = rank_state(state, layout)
    scaler = initial_scaler_state(asdict(precision.scaler)) if precision.scaler else {}
    args = [
        *(p.requires_grad_(True) for p in local.params.values()),
        *(b.detach().clone() for b in state.buffers.values()),
        *(local.optimizer_state[f"{n}:{k}"].clone() for n, k in state.optimizer_slots),
        *lr_args,
        *scaler.values(),
        *inputs,
        targets,
    ]
    slots = [
        *(_slot("param", name=n) for n in state.params),
        *(_slot("buffer", name=n) for n in state.buffers),
        *(_slot("optim", name=n, key=k) for n, k in state.optimizer_slots),
        *(_slot("lr", group=i) for i in range(len(state.param_groups))),
        *(_slot("scaler", key=k) for k in scaler),
        *(_slot("input", t, index=i) for i, t in enumerate(inputs)),
        _slot("target", targets),
    ]
    return args, slots


def _capture(
    mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout, tp: TensorParallel | None, tracer=None
) -> CapturedStep:
    dispatches = Dispatches()
    step, _ = step_program(mf, state, len(inputs), layout, tp, dispatches)
    args, slots = step_args(state, layout, inputs, targets)
    # every node knows its module call (recomputation checkpoints layers by them), in the
    # planner's traces as in the build's
    # SyncBatchNorm's statistics over the ranks holding different samples (dp, fsdp; not tp)
    model = state.model if tp is None else tp.model
    data_groups = [g for g in (layout.fsdp, layout.dp, layout.ep) if g is not None]
    contexts = (annotate_module_calls(model), sync_batchnorm_in_graph(model, data_groups), experts_of(model, layout, dispatches))
    graph = trace_user_code(step, args, mf, "the training step", *contexts, tracer=tracer)
    # Export re-traces the graph with in-place updates on these inputs; they must not require grad.
    example = [a.detach() for a in args]
    outputs = ("loss", "global_loss", *(["found_inf"] if layout.precision.scaler else []), *(["moe_dropped"] if dispatches.dropped else []))
    capacity = max(dispatches.capacity) if dispatches.capacity else None
    return CapturedStep(graph=graph, slots=slots, example_args=example, outputs=outputs, ep_capacity=capacity)


def experts_of(model: torch.nn.Module, layout: StepLayout, dispatches: Dispatches | None = None):
    """The experts' dispatch over the layout's ep group while a step is traced (nothing without ep),
    recording what it made in `dispatches` where given."""
    if layout.ep is None:
        return contextlib.nullcontext()
    tp = (layout.tp.size, layout.tp.name) if layout.tp is not None else None
    return experts_in_graph(model, layout.ep_layers, layout.ep.size, layout.ep.name, layout.ep_capacity_factor, dispatches or Dispatches(), tp)


@dataclass
class RankState:
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]


def cut_like(value: torch.Tensor, cut) -> torch.Tensor:
    """`cut(value)`, a piece of `value` (a slice, a shard). A fake tensor's piece (the build's,
    which the trace reads for its shape only) is cut from a meta stand-in and made anew with the
    piece's shape and strides: cut through the fake mode, op by op, it was 4 s of a
    DeepSeek-V3-sized build."""
    if not isinstance(value, FakeTensor):
        return cut(value)
    piece = cut(torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta"))
    with value.fake_mode:
        return torch.empty_strided(piece.shape, piece.stride(), dtype=piece.dtype, device=value.device)


def rank_state(state: TrainingState, layout: StepLayout, fsdp_index: int = 0, tp_index: int = 0, ep_index: int = 0) -> RankState:
    """The parameters and optimizer state one rank holds: its tensor-parallel slice of every
    parameter `tp_plan` splits, its ep slice of every experts weight (whole otherwise), then its
    fsdp shard of that; optimizer state shaped like its parameter follows the parameter, 0-dim
    state (step counters) is replicated."""
    dims, fused = layout.tp_dims(state), layout.tp_fused(state)
    tp_size = layout.tp.size if layout.tp else 1
    parts = layout.fsdp.size if layout.fsdp else 1
    experts = set(layout.ep_params)

    def cut(name: str, value: torch.Tensor) -> torch.Tensor:
        piece = tp_slice(value, dims.get(name), tp_size, tp_index, fused.get(name, 1))
        if name in experts:
            assert layout.ep is not None  # ep_params is empty without an ep group
            piece = expert_slice(piece, layout.ep.size, ep_index)
        return piece if parts == 1 else shard(piece, parts, fsdp_index)

    def place(name: str, value: torch.Tensor) -> torch.Tensor:
        return cut_like(value, lambda v: cut(name, v))

    params = {n: place(n, p) for n, p in state.params.items()}
    optimizer_state = {}
    for name, key in state.optimizer_slots:
        value = state.optimizer_state[optimizer_key(name, key)]
        if value.dim() == 0:
            optimizer_state[optimizer_key(name, key)] = value.clone()
        elif value.shape == state.params[name].shape:
            optimizer_state[optimizer_key(name, key)] = place(name, value)
        elif parts == 1 and name not in dims and name not in experts:
            optimizer_state[optimizer_key(name, key)] = value.clone()
        else:
            raise AotError(f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, unlike its parameter; it cannot be sharded")
    return RankState(params, optimizer_state)

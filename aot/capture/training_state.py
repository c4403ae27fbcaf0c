"""The starting point of training, recorded rather than computed: weights, optimizer state, schedule.

The build never materializes the model. `model()` runs once under make_fx on fake tensors: that
both gives the fake-tensor model the step is traced on and records, as the *init program*, the
factory and in-place init ops (`empty`, `normal_`, `uniform_`, `fill_`, ...) that create each
parameter and buffer. The runner replays that program after `torch.manual_seed(seed)` and gets
exactly the tensors of `torch.manual_seed(seed); model()` (runner/execution/init_program.py), so build time,
build memory and artifact size follow the graph, not the parameter count.

torch.optim creates optimizer state lazily inside `step()`, which a traced step would redo every
time, so the state is created here once, before tracing, and passed to the program as inputs. Its
initial values are constants per tensor (zeros, step counters, Adagrad's initial accumulator):
they are read from the same optimizer run on tiny real tensors and recorded as fills, from which
the runner creates the state; the state itself is never shipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx

from aot.capture.inert_calls import drop_inert_calls
from aot.capture.model_file import ModelFile, call_user, describe_error
from aot.capture.recorded_initializers import recorded_initializers
from aot.capture.trace_logs import quiet_trace_logs
from aot.errors import AotError
from runner.format.checkpoint import optimizer_key


# Constants a constructor may bake into a parameter or buffer (a small lookup table, say); a
# bigger one was read from somewhere (a file, numpy) and would put weights back into the artifact.
MAX_INIT_CONSTANT_BYTES = 1 << 20
STEP_BRANCHES = "use an optimizer whose step() does not decide by values (SGD, Adam, AdamW, ...)"
CONSTRUCTOR_READS_VALUES = (
    "the build records model() without running it on real tensors, so the constructor must not read tensor "
    "values: decide from Python numbers (a config), or initialize in a way that draws without looking"
)


@dataclass
class TrainingState:
    model: nn.Module  # on fake tensors: no parameter memory
    params: dict[str, torch.Tensor]  # named_parameters(): a tied weight once (fake)
    buffers: dict[str, torch.Tensor]  # every buffer, persistent or not (fake)
    init_graph: torch.fx.GraphModule | None  # the init program: creates params then buffers, in that order (None: not recorded)
    optimizer_slots: list[tuple[str, str]]  # (parameter name, state key), in trace order
    optimizer_state: dict[str, torch.Tensor]  # keyed by runner.format.checkpoint.optimizer_key (fake)
    optimizer_fills: dict[str, float]  # the initial value of every element of each state tensor
    param_groups: list[list[str]]  # parameter names of each optimizer group
    optimizer_class: str
    group_settings: list[dict]  # each group's settings as the optimizer holds them (all but "params")
    lr_schedule: list[list[float]]  # learning rate of every group at every step
    lr_constant: bool
    aliases: dict[str, str] = field(default_factory=dict)  # state_dict key -> canonical name
    state_dict_keys: list[str] = field(default_factory=list)
    # a stacked experts weight -> the parameters it stacks, in expert order (aot/capture/listed_experts.py)
    stacked: dict[str, list[str]] = field(default_factory=dict)

    @property
    def init_program(self) -> torch.fx.GraphModule:
        """The recorded init program (a state made with build_training_state(record=True), the build's)."""
        assert self.init_graph is not None, "the state was made without recording model()'s construction (record=False: the planner's)"
        return self.init_graph

    @property
    def hyperparameters(self) -> list[dict]:
        """Each group's settings as JSON (the manifest's `optimizer.param_groups`)."""
        return [{k: _json_value(v) for k, v in g.items()} for g in self.group_settings]


def _canonical_names(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    """state_dict keys that are second names of a tied tensor, mapped to its first name."""
    first: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        first.setdefault(id(t), name)
    keys = list(model.state_dict(keep_vars=True))
    tensors = model.state_dict(keep_vars=True)
    aliases = {k: first[id(t)] for k, t in tensors.items() if first.get(id(t), k) != k}
    return aliases, keys


def _check_no_shared_storage(params: dict, buffers: dict, where: str) -> None:
    """Each parameter and buffer must own its memory: the artifact stores and updates them as
    separate tensors, so a buffer that views a parameter would silently stop following it."""
    owners: dict[int, str] = {}
    for name, t in [*params.items(), *buffers.items()]:
        if t.numel() == 0:
            continue
        key = t.untyped_storage()._cdata  # the storage's identity (fake tensors have no data pointer)
        if key in owners and owners[key] != name:
            raise AotError(f"{where}: {name!r} shares memory with {owners[key]!r}; give each buffer its own storage (e.g. .clone())")
        owners[key] = name


def _json_value(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)


def _check_supported(opt: torch.optim.Optimizer) -> None:
    import inspect

    closure = inspect.signature(type(opt).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        # LBFGS re-evaluates the loss inside step(); a step graph calls the model once
        raise AotError(
            f"{type(opt).__name__} steps with a closure (it re-evaluates the loss inside step()), which "
            f"one traced training step cannot express; use an optimizer whose step() takes no closure"
        )
    if isinstance(opt, torch.optim.SGD):
        for group in opt.param_groups:
            if group.get("momentum", 0) and group.get("dampening", 0):
                # torch.optim copies the first gradient into a fresh momentum buffer without
                # dampening; a static graph starting from a zero buffer would apply it.
                raise AotError("SGD with momentum and dampening != 0 is not supported: its first step differs from later ones")
    for group in opt.param_groups:
        if group.get("fused"):
            raise AotError(f"{type(opt).__name__}(fused=True) cannot be traced; leave fused unset")


# torch.optim's own optimizers that make each parameter's state from that parameter alone (its
# shape, strides, dtype, device) and its group's settings, never from another parameter, and
# step on fake tensors (ASGD and Rprop branch on values): exact types only, since a subclass may
# keep state across parameters
PER_PARAMETER_STATE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create torch.optim's lazy state with one step that changes nothing, then rewind it.

    The step runs with zero gradients, learning rate 0 and weight decay 0, so every state tensor
    holds its initial value (zeros, or Adagrad's initial accumulator) except step counters,
    which are reset to 0. Parameters are restored bit for bit all the same.

    On fake parameters (the model's, recorded: no values, only the state's layout) of one of
    torch.optim's own optimizers (PER_PARAMETER_STATE), the step runs over one parameter of each
    layout per group, and the others get state laid out as that one's: single-tensor AdamW is
    about twenty fake ops a parameter, a second of Llama-3-70B's 723 before any plan or build
    can trace (tests/test_optimizer_state.py compares every optimizer's state both ways)."""
    fake = all(isinstance(p, FakeTensor) for g in opt.param_groups for p in g["params"])
    if not (fake and type(opt) in PER_PARAMETER_STATE):
        _stepped_once(opt, fake)
        return
    groups = [g["params"] for g in opt.param_groups]
    kinds: list[dict] = [{} for _ in groups]  # per group: layout -> the parameter stepped for it
    for g, kind in zip(opt.param_groups, kinds):
        for p in g["params"]:
            kind.setdefault(_layout(p), p)
        g["params"] = list(kind.values())
    try:
        _stepped_once(opt, fake)
    finally:
        for g, params in zip(opt.param_groups, groups):
            g["params"] = params
    for params, kind in zip(groups, kinds):
        for p in params:
            stepped = kind[_layout(p)]
            if p is not stepped:
                opt.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[stepped].items()}


def _layout(p: torch.Tensor) -> tuple:
    return (tuple(p.shape), p.stride(), p.storage_offset(), p.dtype, p.device, p.requires_grad)


def _stepped_once(opt: torch.optim.Optimizer, fake: bool) -> None:
    """_init_optimizer_state's step over every parameter of `opt` (all `fake`, or none)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    # fake parameters (the model's, recorded) hold no values to restore: not copied twice over
    saved = None if fake else [p.detach().clone() for p in params]
    settings = [(g.get("lr"), g.get("weight_decay")) for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    with torch.no_grad():
        for p, s in zip(params, saved or []):
            p.copy_(s)
    for p in params:
        p.grad = None
    for g, (lr, wd) in zip(opt.param_groups, settings):
        g["lr"] = lr
        if wd is not None:
            g["weight_decay"] = wd
    for p in params:
        for key, value in opt.state[p].items():
            if not isinstance(value, torch.Tensor):
                raise AotError(f"{type(opt).__name__} keeps non-tensor state {key!r}; only tensor state can live in a static graph")
            if key == "step":
                value.zero_()


def _evaluate_schedule(mf: ModelFile, opt: torch.optim.Optimizer, max_steps: int) -> tuple[list[list[float]], bool]:
    lrs = lambda: [float(g["lr"]) for g in opt.param_groups]
    if mf.scheduler is None:
        return [lrs()], True
    saved = [dict(g) for g in opt.param_groups]
    scheduler = call_user(mf.scheduler, "scheduler(optimizer)", mf.path, opt)
    schedule = []
    with warnings.catch_warnings():
        # The schedule is evaluated without optimizer steps; torch warns about that order.
        warnings.simplefilter("ignore")
        for _ in range(max_steps):
            schedule.append(lrs())
            call_user(scheduler.step, "scheduler.step()", mf.path)
    for g, s in zip(opt.param_groups, saved):
        g.clear()
        g.update(s)
    return schedule, False


def _record_init(mf: ModelFile, record: bool = True) -> tuple[nn.Module, torch.fx.GraphModule | None, int, int]:
    """(the model on fake tensors, the init program's graph, #params, #buffers): `model()` traced
    by make_fx, its parameters then its buffers as the graph's outputs. `record=False`: `model()`
    run on fake tensors of the mode make_fx would make, without recording it (no graph: what the
    planner asks, which never writes an init program; recording costs Llama-3-70B's planning a
    second before any trace can start)."""
    made = {}

    def construct():
        # a constructor that runs eagerly can fail here: say why
        model = call_user(mf.model, "model()", mf.path, reading_values=CONSTRUCTOR_READS_VALUES)
        if not isinstance(model, nn.Module):
            raise AotError(f"{mf.path.name}: model() must return a torch.nn.Module, got {type(model).__name__}")
        made["model"] = model
        return [*dict(model.named_parameters()).values(), *dict(model.named_buffers()).values()]

    if not record and _made_fake(construct):
        model = made["model"]
        return model, None, len(dict(model.named_parameters())), len(dict(model.named_buffers()))
    with torch.no_grad(), quiet_trace_logs(), recorded_initializers():
        graph = make_fx(construct, tracing_mode="fake")()
    drop_inert_calls(graph)
    model = made["model"]
    return model, graph, len(dict(model.named_parameters())), len(dict(model.named_buffers()))


def _made_fake(construct) -> bool:
    """Whether `construct()` ran in the fake tensor mode make_fx(tracing_mode="fake") would trace
    it in (torch.fx.experimental.proxy_tensor's _init_modes_from_inputs: the model the build
    records) and made every tensor it returned there. False where it raised or returned a tensor
    made outside that mode (a table from numpy): the recording then says what the build says."""
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=False, shape_env=ShapeEnv(), static_shapes=True)
    converter = mode.fake_tensor_converter
    convert = converter.from_real_tensor
    largest = [0]  # the most bytes of a real tensor the mode took in (make_fx records it as a constant)

    def converted(fake_mode, t, *args, **kwargs):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return convert(fake_mode, t, *args, **kwargs)

    converter.from_real_tensor = converted  # type: ignore[method-assign]  # this mode's converter only, while construct() runs
    try:
        with torch.no_grad(), quiet_trace_logs(), recorded_initializers(), mode:
            made = construct()
    except Exception:  # noqa: BLE001  (recorded instead, which says why where it fails too)
        return False
    finally:
        del converter.from_real_tensor
    return largest[0] <= MAX_INIT_CONSTANT_BYTES and all(isinstance(t, FakeTensor) and t.fake_mode is mode for t in made)


def _check_recordable(mf: ModelFile, graph: torch.fx.GraphModule, names: list[str], n_params: int) -> None:
    """Refuse a parameter or buffer made from a big tensor the constructor got outside torch's
    factory ops (a file, numpy): the init program would carry the values instead of the recipe."""
    outputs = torch.utils._pytree.tree_leaves(next(n for n in graph.graph.nodes if n.op == "output").args)
    for index, (name, node) in enumerate(zip(names, outputs)):
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen or not isinstance(n, torch.fx.Node):
                continue
            seen.add(n)
            if n.op == "get_attr":
                assert isinstance(n.target, str)  # a get_attr node's target is the attribute's name
                value = getattr(graph, n.target)
                size = value.numel() * value.element_size()
                if size > MAX_INIT_CONSTANT_BYTES:
                    kind = "parameter" if index < n_params else "buffer"
                    raise AotError(
                        f"{mf.path.name}: model() makes {kind} {name!r} from a {size / 2**20:.1f} MiB tensor it got outside "
                        f"torch's factory functions (a file, numpy); an artifact records how weights are created, not "
                        f"their values: create it with torch ops, or start training from your weights with `aot run --init-from`"
                    )
            stack.extend(n.all_input_nodes)


def _optimizer_fills(mf: ModelFile, params: dict[str, torch.Tensor], slots: list[tuple[str, str]]) -> dict[str, float]:
    """The initial value of each optimizer state tensor, read from the user's optimizer created
    over one-element stand-ins of the parameters (same dtype and number of dimensions, so
    optimizers that group parameters by `dim()` group them alike) and initialized the same way."""
    # they require grad as the parameters do: optimizer() may keep only those that do (nanoGPT's,
    # torchtitan's `filter(lambda p: p.requires_grad, ...)`)
    probes = [torch.zeros([1] * p.dim(), dtype=p.dtype, requires_grad=p.requires_grad) for p in params.values()]
    opt = call_user(mf.optimizer, "optimizer(params)", mf.path, probes)
    _init_optimizer_state(opt)
    by_name = dict(zip(params, probes))
    fills = {}
    for name, key in slots:
        value = opt.state[by_name[name]].get(key)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise AotError(
                f"{type(opt).__name__}: the initial state {key!r} of {name!r} is not one value per element; "
                f"only optimizers whose initial state is a constant can be recorded"
            )
        fills[optimizer_key(name, key)] = float(value.item())
    return fills


def build_training_state(mf: ModelFile, seed: int, max_steps: int, record: bool = True) -> TrainingState:
    """The model on fake tensors and its init program, the optimizer's state layout and initial
    values, and the learning rate of every step. `seed` is the runner's to apply (the init
    program is replayed after torch.manual_seed(seed)); it does not change what is recorded.
    `record=False`: no init program (`init_graph` None; the planner's), the rest as recorded."""
    model, graph, n_params, n_buffers = _record_init(mf, record)
    model.train()
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    if not params:
        raise AotError(f"{mf.path.name}: the model has no parameters to train")
    frozen = sorted(n for n, p in params.items() if not p.requires_grad)
    if frozen:  # the step would train them: every parameter is a gradient's input and the optimizer's
        raise AotError(
            f"{mf.path.name}: the model has frozen parameters (requires_grad=False: {', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}), "
            f"which aot does not train around yet; register them as buffers (module.register_buffer) to keep them fixed"
        )
    buffers = dict(model.named_buffers())
    _check_no_shared_storage(params, buffers, mf.path.name)
    if graph is not None:
        _check_recordable(mf, graph, [*params, *buffers], n_params)
    fake_mode = torch._guards.detect_fake_mode(list(params.values()))
    assert fake_mode is not None  # _record_init builds the model on fake tensors
    names = {id(p): n for n, p in params.items()}
    with fake_mode:
        opt = call_user(mf.optimizer, "optimizer(params)", mf.path, list(params.values()))
        if not isinstance(opt, torch.optim.Optimizer):
            raise AotError(f"{mf.path.name}: optimizer(params) must return a torch.optim.Optimizer, got {type(opt).__name__}")
        _check_supported(opt)
        groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
        if sorted(n for g in groups for n in g) != sorted(params):
            raise AotError(f"{mf.path.name}: optimizer(params) must optimize every parameter of the model exactly once")
        try:
            _init_optimizer_state(opt)
        except AotError:
            raise
        except Exception as e:  # Adafactor's step branches on a tensor's value, say
            raise AotError(f"{mf.path.name}: {type(opt).__name__}.step() cannot be traced: {describe_error(e, mf.path, STEP_BRANCHES)}") from e
    slots, state = [], {}
    for group in groups:
        for name in group:
            for key, value in sorted(opt.state[params[name]].items()):
                slots.append((name, key))
                state[optimizer_key(name, key)] = value.detach()
    fills = _optimizer_fills(mf, params, slots)
    schedule, constant = _evaluate_schedule(mf, opt, max_steps)
    aliases, keys = _canonical_names(model)
    return TrainingState(
        model=model,
        params=params,
        buffers=buffers,
        init_graph=graph,
        optimizer_slots=slots,
        optimizer_state=state,
        optimizer_fills=fills,
        param_groups=groups,
        optimizer_class=type(opt).__name__,
        group_settings=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        lr_schedule=schedule,
        lr_constant=constant,
        aliases=aliases,
        state_dict_keys=keys,
    )

"""Expert parallelism for experts held as an nn.ModuleList, the layout of GShard, Switch
Transformer, DeepSpeed-MoE and most hand-written mixtures of experts: `experts[e](buffer[e])`
called once per expert by the block's own loop, on the rows of one static dispatch buffer
[E, C, H] the block filled (its routing, its capacity).

Two things make such a layer one program for every ep rank:

- **Stacked weights.** Each parameter path of the experts (`w1.weight`, ...) becomes one stacked
  parameter [E, ...] registered on the ModuleList (`experts.w1__weight`: the path with `__` for
  `.`, `stacked_name`), expert e at index e, in place of the E per-expert parameters in the
  training state, its init program (a `stack` of what the model's constructor drew), the optimizer's
  groups and state. Split along dimension 0 it is an experts weight like transformers' 3-D ones
  (aot/capture/expert_parallel.py), and the artifact's `state.stacked` maps it back to the model's
  own names for checkpoints and `--init-from` (artifacts/FORMAT.md). Stacking changes no number for
  an optimizer that updates element by element (SGD, Adam, AdamW, ...); one that reads a whole
  tensor (Adafactor's factored moments) is refused.
- **One exchange for the layer.** A trace runs the block's calls one at a time, but the ranks must
  move every expert's rows in one all_to_all. The rows of call e are a view of the block's buffer
  (`buffer[e]`, `buffer.chunk(E)[e]`, along any dimension): at the first call the buffer is read
  from the view's base, sent to the ep ranks holding each expert, every local expert runs on every
  source rank's rows (the expert's own forward, on the stacked weights' local slices, one call per
  source rank: the model's own shapes), the results come back, and each call returns its expert's
  rows. A call whose input is not such a view (a data-dependent gather: transformers 4's Mixtral,
  DeepSeek-V3's remote code) is refused in one line: its rows' count is not static.

The block's dispatch is its own, per rank: with its capacity computed from the batch it is given,
ep trains as eager DDP does over the same data ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from aot.capture.group_collectives import exchange
from aot.capture.training_state import TrainingState
from aot.errors import AotError
from runner.format.checkpoint import optimizer_key

STACK_SEPARATOR = "__"  # a parameter's leaf name may hold no "."
# optimizers that update each element from its own gradient and state alone: stacking changes nothing
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "ASGD")


def stacked_leaf(path: str) -> str:
    """The attribute of the ModuleList holding every expert's `path` stacked."""
    return path.replace(".", STACK_SEPARATOR)


def stacked_name(module: str, path: str) -> str:
    """The stacked parameter of every expert's `path` in the ModuleList `module`."""
    return f"{module}.{stacked_leaf(path)}"


@dataclass(frozen=True)
class ListedExperts:
    """An nn.ModuleList of E experts of one class: its name and every expert's parameter paths."""

    module: str
    experts: int
    paths: tuple[str, ...]

    def stacked(self) -> dict[str, list[str]]:
        """Stacked name -> the per-expert parameter names it stacks, in expert order."""
        return {stacked_name(self.module, p): [f"{self.module}.{e}.{p}" for e in range(self.experts)] for p in self.paths}


def listed_experts(model: nn.Module) -> tuple[ListedExperts, ...]:
    """Every nn.ModuleList named `experts` holding more than one module of one class, with the same
    parameters (names, shapes, dtypes) and no buffers, in module order."""
    found = []
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts" or not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        layouts = {tuple((n, tuple(p.shape), p.dtype) for n, p in e.named_parameters()) for e in m}
        if len({type(e) for e in m}) == 1 and len(layouts) == 1 and next(iter(layouts)) and not any(True for e in m for _ in e.buffers()):
            found.append(ListedExperts(name, len(m), tuple(n for n, _, _ in next(iter(layouts)))))
    return tuple(found)


def stacked_layers(model: nn.Module) -> tuple[ListedExperts, ...]:
    """The ModuleLists whose experts `stack_experts` stacked (their stacked parameters registered)."""
    modules = dict(model.named_modules())
    return tuple(layer for layer in listed_experts(model) if all(n.rsplit(".", 1)[1] in modules[layer.module]._parameters for n in layer.stacked()))


def stack_experts(state: TrainingState, where: str) -> TrainingState:
    """The training state with every listed experts layer's parameters stacked (module docstring);
    the same state when the model has none. Refuses tied expert weights, experts split between
    optimizer groups and optimizers that do not update element by element."""
    layers = listed_experts(state.model)
    if not layers:
        return state
    if state.optimizer_class not in ELEMENTWISE_OPTIMIZERS:
        raise AotError(
            f"--strategy ep: {where} holds its experts as an nn.ModuleList, which ep stacks into one [E, ...] weight per parameter; "
            f"{state.optimizer_class} may update a stacked weight differently from its experts' own (only {', '.join(ELEMENTWISE_OPTIMIZERS)} cannot)"
        )
    stacked = {s: names for layer in layers for s, names in layer.stacked().items()}
    of = {n: (s, e) for s, names in stacked.items() for e, n in enumerate(names)}
    tied = sorted(n for n in of if n in state.aliases or n in state.aliases.values())
    if tied:
        raise AotError(f"--strategy ep: {where}: expert weight {tied[0]} is tied to another parameter; ep cannot stack it")
    group_of = {n: g for g, names in enumerate(state.param_groups) for n in names}
    for names in stacked.values():
        if len({group_of[n] for n in names}) > 1:
            raise AotError(f"--strategy ep: {where}: the experts' {names[0]} and {names[-1]} are in different optimizer groups; ep stacks them into one weight")
    fake_mode = torch._guards.detect_fake_mode(list(state.params.values()))
    with fake_mode or torch._subclasses.fake_tensor.unset_fake_temporarily():
        params = _stacked_dict(state.params, of, stacked, lambda ts: torch.stack(ts).detach())
        opt_state = {}
        for name, key in state.optimizer_slots:
            s, e = of.get(name, (name, 0))
            if e == 0:
                values = [state.optimizer_state[optimizer_key(n, key)] for n in stacked.get(s, [name])]
                # state shaped like its parameter is stacked with it; a step counter (0-dim) is one for all
                shaped = s in stacked and values[0].shape == state.params[name].shape
                opt_state[optimizer_key(s, key)] = torch.stack(values) if shaped else values[0]
    modules = dict(state.model.named_modules())
    for s in stacked:
        module, leaf = s.rsplit(".", 1)
        if hasattr(modules[module], leaf):
            raise AotError(f"--strategy ep: {where}: {module} already has an attribute {leaf!r}, the name ep would give its stacked experts weight")
        modules[module].register_parameter(leaf, nn.Parameter(params[s], requires_grad=True))
        params[s] = modules[module]._parameters[leaf]
    fills: dict[str, float] = {}
    for name, key in state.optimizer_slots:
        s = of.get(name, (name, 0))[0]
        starts = {state.optimizer_fills[optimizer_key(n, key)] for n in stacked.get(s, [name])}
        if len(starts) > 1:
            raise AotError(f"--strategy ep: {where}: the experts of {s} start with different optimizer state {key!r}; ep cannot stack them")
        fills[optimizer_key(s, key)] = starts.pop()
    renamed = lambda names: list(dict.fromkeys(of.get(n, (n, 0))[0] for n in names))  # noqa: E731
    return replace(
        state,
        params=params,
        init_graph=None if state.init_graph is None else _stacked_init(state.init_graph, list(state.params), of, stacked),
        optimizer_slots=list(dict.fromkeys((of.get(n, (n, 0))[0], k) for n, k in state.optimizer_slots)),
        optimizer_state=opt_state,
        optimizer_fills=fills,
        param_groups=[renamed(g) for g in state.param_groups],
        stacked=stacked,
    )


def _stacked_dict(tensors: dict, of: dict, stacked: dict, stack) -> dict:
    """`tensors` by name with each stacked group replaced, where its first expert's stood, by
    `stack` of the group's tensors."""
    out = {}
    for name, t in tensors.items():
        s, e = of.get(name, (name, 0))
        if e == 0:
            out[s] = stack([tensors[n] for n in stacked[s]]) if s in stacked else t
    return out


def _stacked_init(graph: torch.fx.GraphModule, names: list[str], of: dict, stacked: dict) -> torch.fx.GraphModule:
    """The init program returning the stacked weights in place of the experts' own: a `stack` of
    the tensors the model's constructor made (the same draws, so `torch.manual_seed(seed);
    model()` still gives every expert's values). Its outputs stay parameters, then buffers."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    results = list(out.args[0])
    by_name = dict(zip(names, results[: len(names)]))
    with graph.graph.inserting_before(out):
        stacked_nodes = {}
        for s, group in stacked.items():
            node = graph.graph.call_function(torch.ops.aten.stack.default, ([by_name[n] for n in group], 0))
            values = [by_name[n].meta.get("val") for n in group]
            if all(v is not None for v in values):
                with torch._guards.detect_fake_mode(values) or torch._subclasses.fake_tensor.unset_fake_temporarily():
                    node.meta["val"] = torch.stack(values)
            stacked_nodes[s] = node
    params = list(_stacked_dict(by_name, of, stacked, lambda _nodes: None))
    out.args = ([stacked_nodes.get(n) or by_name[n] for n in params] + results[len(names) :],)
    graph.graph.lint()
    graph.recompile()
    return graph


class _LayerDispatch:
    """One ModuleList's calls while a step is traced (module docstring): the first call exchanges
    every expert's rows; each call returns its expert's."""

    def __init__(self, experts: nn.ModuleList, layer: ListedExperts, ranks: int, group: str, tp: tuple[int, str] | None = None):
        self.experts, self.layer, self.ranks, self.group, self.tp = experts, layer, ranks, group, tp
        self.computing = False
        self.base: torch.Tensor | None = None

    def forward_of(self, index: int):
        module = self.experts[index]

        def forward(*args, **kwargs):
            if self.computing:  # the expert's own forward, on the local weights
                return type(module).forward(module, *args, **kwargs)
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                raise AotError(
                    f"--strategy ep: {self.layer.module}.{index} is called with {len(args)} argument(s); ep dispatches experts called on one tensor of rows"
                )
            if index == 0:
                self._exchange(args[0])
            elif self.base is None or not self._is_row(args[0], index):
                raise AotError(self._not_a_row(index))
            return self.out[index]

        return forward

    def _exchange(self, rows: torch.Tensor) -> None:
        found = _row_of(rows, self.layer.experts)
        if found is None:
            raise AotError(self._not_a_row(0))
        self.base, self.step = found
        self.shape, self.stride, self.offset = rows.shape, rows.stride(), rows.storage_offset()
        every = self.base.as_strided((self.layer.experts, *rows.shape), (self.step, *rows.stride()), self.offset)  # [E, *rows]
        if self.tp is not None:  # the tp ranks hold the same buffer: each dispatches its 1/tp of every expert's rows
            from aot.capture.tensor_parallel import split_sequence

            size, group = self.tp
            count = rows.shape[0] if rows.dim() else 1
            if rows.dim() == 0 or count % size:
                raise AotError(f"--strategy ep with tp={size}: {self.layer.module}'s experts take {count} rows, which {size} tp ranks cannot share evenly")
            every = split_sequence(every, size, group)
        n, local = self.ranks, self.layer.experts // self.ranks
        received = exchange(every, n, self.group).view(n, local, *every.shape[1:])  # from rank s: its rows for my experts
        weights = {p: getattr(self.experts, stacked_leaf(p)) for p in self.layer.paths}  # the local rows, bound by functional_call
        self.computing = True
        try:
            out = torch.stack([torch.stack([self._run(k, received[s, k], weights) for k in range(local)]) for s in range(n)])
        finally:
            self.computing = False
        self.out = exchange(out.flatten(0, 1), n, self.group)  # my rows' results, in expert order
        if self.tp is not None:  # every tp rank's share of the rows, whole again
            from aot.capture.tensor_parallel import gather_sequence

            self.out = gather_sequence(self.out, *self.tp)

    def _run(self, slot: int, rows: torch.Tensor, weights: dict) -> torch.Tensor:
        return torch.func.functional_call(self.experts[slot], {p: w[slot] for p, w in weights.items()}, (rows,))

    def _is_row(self, rows: torch.Tensor, index: int) -> bool:
        same = rows._base is self.base and rows.shape == self.shape and rows.stride() == self.stride
        return same and rows.storage_offset() == self.offset + index * self.step

    def _not_a_row(self, index: int) -> str:
        return (
            f"--strategy ep: {self.layer.module}.{index} is not called on row block {index} of one [E, ...] dispatch buffer "
            f"(buffer[e] or buffer.chunk(E)[e] of a tensor the block filled, every expert in order); ep moves a ModuleList's rows "
            f"in one all_to_all, which a data-dependent selection (torch.where, boolean indexing) cannot give a static size"
        )


def _row_of(rows: torch.Tensor, experts: int) -> tuple[torch.Tensor, int] | None:
    """(base, expert stride) where `rows` is the first of `experts` equal row blocks of one buffer
    viewing its base: `buffer[0]` or `buffer.chunk(experts, d)[0]` of a buffer whose dimensions are
    a permutation of the base's (an einsum's result is often a permuted view), so that block e is
    `rows` moved e x stride along the base's storage. None where no single dimension of the base
    is left over for the experts."""
    base = rows._base
    if base is None:
        return None
    left = list(zip(base.shape, base.stride()))
    for pair in zip(rows.shape, rows.stride()):
        if pair in left:
            left.remove(pair)
        else:  # a chunk: the base's dimension is `experts` times the block's, at the same stride
            size, stride = pair
            if (size * experts, stride) not in left:
                return None
            left.remove((size * experts, stride))
            left.append((experts, size * stride))
    left = [(size, stride) for size, stride in left if size != 1]
    return (base, left[0][1]) if len(left) == 1 and left[0][0] == experts else None


def listed_forwards(model: nn.Module, layers: tuple[ListedExperts, ...], ranks: int, group: str, tp: tuple[int, str] | None = None) -> dict:
    """module -> the forward it runs while the step is traced, for every expert of `layers`
    (aot/capture/module_calls.py `forwards_replaced`); with `tp` (size, group name) each tp rank
    dispatches its 1/tp of every expert's rows, and the results are gathered back."""
    modules = dict(model.named_modules())
    forwards = {}
    for layer in layers:
        experts = modules[layer.module]
        assert isinstance(experts, nn.ModuleList)
        dispatch = _LayerDispatch(experts, layer, ranks, group, tp)
        forwards.update({experts[e]: dispatch.forward_of(e) for e in range(layer.experts)})
    return forwards

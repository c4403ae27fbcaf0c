"""Expert parallelism (`--strategy ep=N`): each ep rank holds E/N of a mixture-of-experts layer's
experts, and tokens travel to the rank holding their expert and back by all_to_all, inside the
static graph.

The experts are found by structure (aot does not import transformers): a module whose own
parameters are transformers' 3-D expert weights, `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], called as `experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`
(transformers v5's MoE blocks: Qwen3-MoE, Mixtral, and the others decorated with
`use_experts_implementation`). While the step is traced, `experts_in_graph` puts an instance
`forward` in front of each one's class forward (as SyncBatchNorm's is, aot/capture/sync_batchnorm.py);
the router, the shared experts and the load-balancing loss stay the model's own code, so tokens
are routed exactly as the model routes them. Experts held as an nn.ModuleList are stacked into
such weights and dispatched from the block's own buffer (aot/capture/listed_experts.py).

Static dispatch (no data-dependent shapes, no host sync): every (rank, expert) pair exchanges
exactly C rows. Slot (token t, choice k) takes position p inside its expert's C rows, counted
choice-major (every token's first choice before any second choice) by a cumulative sum over the
routing mask; the send buffer [E*C, H] is a gather of the tokens by position (zero rows where an
expert got fewer than C), laid out [N, E/N, C, H] so that chunk r goes to ep rank r. The holder
runs its E/N experts as batched matmuls on [E/N, N*C, H], sends the results back the same way,
and each slot reads its row, weighted and summed over the K choices in top-k order, as
transformers' grouped_mm combine does. With C = T (the default, "dropless": top-k picks K
distinct experts, so no expert gets more than T of one rank's slots) no token is dropped and the
step computes what eager DDP computes over the same data ranks.

With a capacity factor f (`aot build --moe-capacity-factor f`), C = ceil(f x T x K / E): each
rank sends each expert at most C of its own tokens' choices, in the order above (every first
choice, in token order, then every second choice, ...); a choice past C is dropped: it adds nothing
to its token's output (the residual still carries the token) and its routing weight gets no
gradient. Which choices drop depends only on the rank's own batch. Under tensor parallelism each
tp rank dispatches its contiguous 1/tp of the rank's tokens (below), and a pipeline each
microbatch on its own: T, the capacity and the drop rule are then those of that share. The step
then also returns the number of choices dropped over every data and tp rank (with pp, every
microbatch's, counted in the last stage: aot/capture/stages.py; the artifact's output
`moe_dropped`, in `aot run --metrics`).

Gradients: the reverse all_to_all sums every ep rank's tokens' contributions into the holder's
expert gradient, so expert gradients are reduced over the ranks holding the same experts (fsdp,
dp) but not over ep, and divided by every data rank (aot/capture/step.py `finish`).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from aot.capture.listed_experts import ListedExperts, listed_forwards, stacked_layers, stacked_name
from aot.capture.group_collectives import exchange
from aot.capture.module_calls import forwards_replaced
from aot.errors import AotError

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertLayer:
    """One experts module: its name in the model and how many experts it holds."""

    module: str
    experts: int
    listed: tuple[str, ...] = ()  # an nn.ModuleList's experts, stacked: every expert's parameter paths (aot/capture/listed_experts.py)

    def params(self) -> tuple[str, ...]:
        if self.listed:
            return tuple(stacked_name(self.module, p) for p in self.listed)
        return tuple(f"{self.module}.{w}" for w in EXPERT_WEIGHTS)


def _is_experts(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    weights = [own.get(w) for w in EXPERT_WEIGHTS]
    return all(w is not None and w.dim() == 3 for w in weights) and weights[0].shape[0] == weights[1].shape[0]  # type: ignore[union-attr]


def expert_layers(model: nn.Module) -> tuple[ExpertLayer, ...]:
    """Every experts module of `model` (see the module docstring), in module order, and every
    ModuleList of experts whose weights the build stacked (aot/capture/listed_experts.py)."""
    held = tuple(ExpertLayer(name, m.gate_up_proj.shape[0]) for name, m in model.named_modules() if _is_experts(m))
    return held + tuple(ExpertLayer(layer.module, layer.experts, layer.paths) for layer in stacked_layers(model))


def _listed_experts(model: nn.Module) -> tuple[str, int] | None:
    """(name, count) of the first nn.ModuleList named `experts` holding modules with parameters,
    or None."""
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(m, nn.ModuleList) and len(m) > 1:
            if any(True for _ in m.parameters()):
                return name, len(m)
    return None


def check_expert_parallel(model: nn.Module, ep: int, where: str, factor: float | None = None) -> tuple[ExpertLayer, ...]:
    """The experts modules ep=`ep` splits, or AotError in one line: no experts, E not divisible by
    ep, experts whose layout the dispatch does not compute (biases, transposed or interleaved
    weights, no gate), or a ModuleList's experts (which dispatch by the model's own capacity) with
    a capacity factor."""
    layers = expert_layers(model)
    listed = [layer.module for layer in layers if layer.listed]
    if listed and factor is not None:
        raise AotError(
            f"--moe-capacity-factor: {where} holds the experts of {listed[0]} as an nn.ModuleList, whose block dispatches "
            f"with its own capacity; leave the factor out (set the capacity in the model)"
        )
    unstacked = _listed_experts(model)
    if unstacked and not layers:
        name, count = unstacked
        raise AotError(
            f"--strategy ep={ep}: {where} holds the {count} experts of {name} as an nn.ModuleList whose experts differ (class, "
            f"parameter shapes) or hold buffers; ep stacks a ModuleList's experts into one [E, ...] weight per parameter, "
            f"which needs experts of one layout; use dp or fsdp"
        )
    if not layers:
        raise AotError(
            f"--strategy ep={ep}: {where} has no mixture-of-experts layer aot can split (a module holding 3-D expert weights "
            f"{' and '.join(EXPERT_WEIGHTS)}, as transformers' MoE models do, or an nn.ModuleList named experts); use dp or fsdp"
        )
    modules = dict(model.named_modules())
    for layer in layers:
        if layer.experts % ep:
            raise AotError(f"--strategy ep={ep}: {layer.module} holds {layer.experts} experts, which {ep} ep ranks cannot share evenly")
        m = modules[layer.module]
        if layer.listed:
            continue
        unsupported = [
            flag
            for flag, bad in (
                ("has_bias", getattr(m, "has_bias", False)),
                ("is_transposed", getattr(m, "is_transposed", False)),
                ("not is_concatenated", not getattr(m, "is_concatenated", True)),
                ("not has_gate", not getattr(m, "has_gate", True)),
                ("has_post_expert_norm", getattr(m, "has_post_expert_norm", False)),
            )
            if bad
        ]
        if unsupported:
            kind = type(m).__name__
            raise AotError(f"--strategy ep={ep}: {layer.module} ({kind}) stores its experts with {', '.join(unsupported)}, which ep does not split yet")
    return layers


@dataclass
class Dispatches:
    """What the experts' dispatch made while one step was traced: each experts call's capacity (rows
    per expert and rank) and, with a capacity factor, its count of dropped choices (a 0-dim tensor of
    the trace)."""

    capacity: list[int] = field(default_factory=list)
    dropped: list[torch.Tensor] = field(default_factory=list)


def capacity_rows(tokens: int, top_k: int, experts: int, factor: float | None) -> int:
    """C: the rows each rank sends each expert. Dropless (factor None): every token (`tokens`, one
    rank's); else ceil(factor x tokens x top_k / experts), at most `tokens`. Refuses a factor that
    leaves an expert less than one row."""
    if factor is None:
        return tokens
    rows = factor * tokens * top_k / experts
    if rows < 1:
        raise AotError(
            f"--moe-capacity-factor {factor:g}: {rows:.3g} rows per expert ({tokens} tokens x top-{top_k} / {experts} experts x {factor:g}); "
            f"under one token per expert, give at least {experts / (tokens * top_k):.3g}"
        )
    return min(tokens, math.ceil(rows))


def dispatch_rows(top_k_index: torch.Tensor, experts: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, slot): `source[j]` is the token that fills row j of the [experts * capacity] send
    buffer (T: a zero row), `slot[t, k]` the row token t's k-th choice comes back in (E*C: a dropped
    choice, which reads a zero row). Integer bookkeeping, the same on every rank for the same
    routing; choice-major positions, so first choices claim capacity first."""
    tokens, k = top_k_index.shape
    flat = top_k_index.t().reshape(-1)  # choice-major: [K*T]
    hot = F.one_hot(flat, experts)  # num_classes given: a static shape
    position = ((hot.cumsum(0) - 1) * hot).sum(1)  # the slot's place among its expert's rows
    dump = experts * capacity
    row = torch.where(position < capacity, flat * capacity + position, torch.full_like(flat, dump))
    source = torch.full((dump + 1,), tokens, dtype=torch.long, device=flat.device)
    source = source.scatter(0, row, torch.arange(k * tokens, device=flat.device) % tokens)  # several writes: only into the dump row
    return source[:dump], row.view(k, tokens).t()


@dataclass(frozen=True)
class Dispatch:
    """How one experts module dispatches: its experts, the ep group's size and name, the capacity
    factor (None: dropless), and where the trace records what it made."""

    experts: int
    ranks: int
    group: str
    factor: float | None
    record: Dispatches
    tp: tuple[int, str] | None = None  # (size, group name): each tp rank dispatches its 1/tp of the tokens


def dispatched_forward(module: nn.Module, how: Dispatch, hidden, top_k_index, top_k_weights):
    """The experts' forward with this rank's E/N experts (`module.gate_up_proj` and `down_proj` are
    the local slices while the step is traced): see the module docstring. Under tensor parallelism
    the tp ranks hold the same tokens: each dispatches its 1/tp of them (a reduce-scatter, as
    sequence parallelism splits the stream) and the results are all-gathered back, so the experts'
    work is not repeated tp times; their gradients are then parts, summed over tp (as
    aot/capture/replicas.py finds for any whole weight used on split values)."""
    if how.tp is None:
        return _dispatched(module, how, hidden, top_k_index, top_k_weights)
    from aot.capture.tensor_parallel import gather_sequence, split_sequence

    size, group = how.tp
    if hidden.shape[0] % size:
        raise AotError(f"expert parallelism with tp={size}: {hidden.shape[0]} tokens per rank cannot be split {size} ways between the tp ranks")
    mine = lambda t: split_sequence(t.unsqueeze(0), size, group)[0]  # noqa: E731
    with torch.no_grad():  # the routing is the same on every tp rank: each takes its rows (exact: small integers)
        index = mine(top_k_index.to(torch.float32)).round().long()
    out = _dispatched(module, how, mine(hidden), index, mine(top_k_weights))
    return gather_sequence(out.unsqueeze(0), size, group)[0]


def _dispatched(module: nn.Module, how: Dispatch, hidden, top_k_index, top_k_weights):
    tokens, width = hidden.shape
    experts, ranks, group = how.experts, how.ranks, how.group
    local = experts // ranks
    c = capacity_rows(tokens, top_k_index.shape[1], experts, how.factor)
    how.record.capacity.append(c)
    with torch.no_grad():
        source, slot = dispatch_rows(top_k_index, experts, c)
        if how.factor is not None:
            how.record.dropped.append((slot == experts * c).sum())
    padded = torch.cat([hidden, hidden.new_zeros(1, width)])
    received = exchange(padded[source], ranks, group)  # [N * E/N * C, H]: from rank r, its rows for my experts
    rows = received.view(ranks, local, c, width).transpose(0, 1).reshape(local, ranks * c, width)
    # the local slices (the step's tensors, bound by functional_call), and the module's own
    # activation on the gate and up halves (transformers' `_apply_gate`)
    gate_up, down = (typing.cast(torch.Tensor, getattr(module, w)) for w in EXPERT_WEIGHTS)
    out = torch.bmm(module._apply_gate(torch.bmm(rows, gate_up.transpose(1, 2))), down.transpose(1, 2))  # type: ignore[operator]
    back = exchange(out.view(local, ranks, c, width).transpose(0, 1).reshape(experts * c, width), ranks, group)
    chosen = torch.cat([back, back.new_zeros(1, width)])[slot]  # [T, K, H]
    return (chosen * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


def experts_in_graph(
    model: nn.Module, layers: tuple[ExpertLayer, ...], ranks: int, group: str, factor: float | None, record: Dispatches, tp: tuple[int, str] | None = None
):
    """While the step is traced: each experts module of `layers` dispatches its tokens to the ep
    ranks holding their experts (`dispatched_forward`, capacity `factor`: None for dropless),
    recording what it made in `record`; nothing when `layers` is empty."""
    modules = dict(model.named_modules())

    def forward_of(module: nn.Module, experts: int):
        how = Dispatch(experts, ranks, group, factor, record, tp)

        def forward(hidden, top_k_index, top_k_weights):
            return dispatched_forward(module, how, hidden, top_k_index, top_k_weights)

        return forward

    forwards = {modules[layer.module]: forward_of(modules[layer.module], layer.experts) for layer in layers if not layer.listed}
    listed = tuple(ListedExperts(layer.module, layer.experts, layer.listed) for layer in layers if layer.listed)
    return forwards_replaced({**forwards, **listed_forwards(model, listed, ranks, group, tp)})

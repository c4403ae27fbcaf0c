"""The least share of a model's gradients a pipeline's busiest rank holds at once, from its
schedule alone: no stage split, no trace.

A pipeline rank sums each parameter's gradient over the microbatches, whole, until the step's end
(aot/capture/pipeline.py: under fsdp the sums are reduce-scattered after the last microbatch), so
once a stage's first backward (zero-bubble: its first weight gradient) has run, the rank holds
that stage's sums. Under fsdp the rank gathers its stages' parameters once per step, and every
forward reads every parameter of its stage, so while a stage has a forward still to run the rank
holds that stage's gathered parameters: in the gradients' dtype (a gradient is the gathered
tensor's), so at least as many bytes as the stage's gradients. (Every stage's forward reads all
of its gathered parameters at one instant only if nothing frees and gathers them again between
forwards: the graph passes re-gather for the backward only, after the loss: aot/passes/regather.py.)
Beside both, the rank holds its stages' shards of the parameters and optimizer state: at least
`resident` times their gradients' bytes.

So at the start of each action of rank r, with stage s holding the fraction x_s of the gradients'
bytes, the rank holds at least sum_s c_s x_s of them, c_s = [s summed] + [s gathered] + resident,
where s is summed from its first backward to its last (under fsdp a pass may reduce-scatter and
free the sum after it; whole gradients are held until the optimizer reads them) and gathered
until its last read.
The stage split is not known here (the build moves it to fit memory), so the floor is the least,
over every split, of the busiest rank's most: min over x >= 0, sum x = 1, of max over ranks and
actions. Rank r can take at most M_r t of the model while holding at most t (M_r = max sum y over
y >= 0 with every action's c . y <= 1, a linear program over the rank's own v stages), so the
busiest rank holds at least 1 / sum_r M_r. M_r is exact for one and two stages per rank and
bounded above, coordinate by coordinate, beyond (still a floor).

Why it matters: 1F1B's last rank runs its last microbatch's forward after its first backward, so
it holds its stage's sums and gathered parameters at once; at pp=2 the busiest rank holds at
least 2/3 of the model's gradients, not the 1/2 the sums alone give, which is what keeps
Llama-3-70B's pp=2 meshes in fp32 (at least 88 GiB a rank on an 80 GB GPU) from being traced
for minutes only to be found not to fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from aot.plan.pipeline import Action

if TYPE_CHECKING:
    from aot.capture.backward_reads import BackwardReads
    from aot.capture.precision import Precision
    from aot.capture.step import StepLayout
    from aot.capture.training_state import TrainingState

_EPSILON = 1e-12


@dataclass(frozen=True)
class PipelineHoldings:
    """What a pipeline mesh's ranks hold, all together, that the floor counts
    (aot.plan.model_steps.ModelSteps.pipeline_holdings): `gradients`, bytes of every parameter's
    gradient as they are summed; `resident`, the least bytes of resident parameter and optimizer
    state per byte of a parameter's gradient; `gathered`, whether parameters are gathered (fsdp);
    `unread`, bytes of gathered parameters the backward may not read (None: not known)."""

    gradients: int
    resident: float
    gathered: bool
    unread: int | None = None


def gradient_bytes(state: TrainingState, layout: StepLayout, precision: Precision, fsdp: int) -> dict[str, int]:
    """Bytes of each parameter's gradient as a mesh's pipeline ranks sum it over microbatches,
    all ranks together (aot/capture/pipeline.py: whole on its rank, of its slice's shape under
    `layout`'s tensor and expert parallelism, in the dtype of what it differentiates: the
    parameter gathered once per step under fsdp, in the compute dtype with mixed precision, else
    the parameter itself)."""
    shapes = layout.local_shapes(state)
    gathered = precision.compute_dtype.itemsize if fsdp > 1 and precision.mixed else None
    return {name: shapes[name].numel() * (gathered or p.element_size()) for name, p in state.params.items()}


def holdings_of(state: TrainingState, layout: StepLayout, sharded: StepLayout, precision: Precision, reads: BackwardReads | None) -> PipelineHoldings:
    """The PipelineHoldings of a mesh whose pipeline ranks run `layout` (its tensor and expert
    parallelism) with `sharded`'s fsdp: the gradients (gradient_bytes) of the parameters the loss
    reaches where `reads` (aot.capture.backward_reads.BackwardReads, or None: unknown) says; the
    state each rank holds resident, its stage's shards of the parameters and optimizer state
    (their sum over the stages is a rank's of the mesh without pp: aot.capture.step.rank_state),
    the least of it per byte of a parameter's gradient; under fsdp the gathered parameters the
    backward does not read."""
    fsdp = sharded.fsdp.size if sharded.fsdp is not None else 1
    gradients = gradient_bytes(state, layout, precision, fsdp)
    if reads is not None:  # a parameter the loss does not reach gets no gradient: none summed, none counted
        gradients = {name: b for name, b in gradients.items() if name in reads.reached}
    held = held_bytes(state, sharded)
    return PipelineHoldings(
        gradients=sum(gradients.values()),
        resident=min((held[name] / b for name, b in gradients.items() if b), default=0.0),
        gathered=fsdp > 1,
        unread=sum(b for name, b in gradients.items() if name not in reads.read) if fsdp > 1 and reads is not None else None,
    )


def held_bytes(state: TrainingState, sharded: StepLayout) -> dict[str, int]:
    """Bytes of each parameter's piece and its optimizer state's pieces that one rank of `sharded`
    holds: aot.capture.step.rank_state's, counted from the shapes (its slices of Llama-3-70B's
    fake state cost the planner a second; tests/test_plan_search.py compares), or from rank_state
    itself where a state tensor is shaped unlike its parameter and not 0-dim."""
    from aot.capture.step import rank_state
    from runner.format.checkpoint import optimizer_key
    from runner.format.sharding import shard_numel

    parts = sharded.fsdp.size if sharded.fsdp is not None else 1
    pieces = {name: shard_numel(shape.numel(), parts) for name, shape in sharded.local_shapes(state).items()}
    held = {name: pieces[name] * p.element_size() for name, p in state.params.items()}
    for name, key in state.optimizer_slots:
        value = state.optimizer_state[optimizer_key(name, key)]
        if value.dim() and value.shape != state.params[name].shape:  # rank_state's own rule (or its refusal)
            return _held_in(rank_state(state, sharded), state.optimizer_slots)
        held[name] += (pieces[name] if value.dim() else 1) * value.element_size()
    return held


def _held_in(local, slots: list) -> dict[str, int]:
    """held_bytes of a rank state (aot.capture.step.RankState) made."""
    from runner.format.checkpoint import optimizer_key

    held = {name: p.numel() * p.element_size() for name, p in local.params.items()}
    for name, key in slots:
        value = local.optimizer_state[optimizer_key(name, key)]
        held[name] += value.numel() * value.element_size()
    return held


def busiest_floor(holdings: PipelineHoldings, actions: list[list[Action]]) -> float:
    """Bytes the busiest rank of a pipeline holds at once at the least, under the schedule
    `actions`, over every stage split: gathered parameters counted until their stage's last
    forward, or, less the bytes the backward may not read, until its last backward."""
    total = holdings.gradients
    if not holdings.gathered:
        return total * busiest_share(actions, None, holdings.resident)
    forward = total * busiest_share(actions, "forward", holdings.resident)
    if holdings.unread is None:
        return forward
    return max(forward, total * busiest_share(actions, "backward", holdings.resident) - holdings.unread)


def busiest_share(actions: list[list[Action]], gathered: str | None, resident: float) -> float:
    """The least fraction of the model's gradient bytes the busiest pipeline rank holds at once
    under the schedule `actions` (aot.plan.pipeline.schedule_actions), over every stage split.
    `gathered`: the parameters are gathered (fsdp) and held until their stage's last forward
    ("forward") or last backward ("backward"), or not gathered (None); `resident`: the least bytes
    of resident parameter and optimizer state per byte of gradient."""
    capacity = sum(_most_of_the_model(rank_holdings(ranks_actions, gathered, resident)) for ranks_actions in actions)
    return 0.0 if capacity == float("inf") else 1.0 / capacity


def rank_holdings(actions: list[Action], gathered: str | None, resident: float) -> set[tuple[float, ...]]:
    """At the start of each of one rank's actions, the bytes it holds per byte of each of its
    chunks' gradients."""
    chunks = 1 + max(a.chunk for a in actions)
    summed_at = "W" if any(a.kind == "W" for a in actions) else "B"  # zero-bubble sums in its W
    read_at = "F" if gathered == "forward" else "B"

    def span(kind: str, chunk: int) -> tuple[int, int]:
        at = [i for i, a in enumerate(actions) if a.kind == kind and a.chunk == chunk]
        return (at[0], at[-1]) if at else (len(actions), -1)

    summing = [span(summed_at, c) for c in range(chunks)]  # a sum is made by the first, needed by the last
    if gathered is None:  # reduced whole (dp), not reduce-scattered: held until the optimizer reads it
        summing = [(first, len(actions)) for first, _ in summing]
    reading = [span(read_at, c) for c in range(chunks)]
    return {
        tuple(resident + (summing[c][0] < i <= summing[c][1]) + (gathered is not None and i <= reading[c][1]) for c in range(chunks))
        for i in range(len(actions))
    }


def _most_of_the_model(holdings: set[tuple[float, ...]]) -> float:
    """max sum(y) over y >= 0 with h . y <= 1 for every h in `holdings` (a rank's share of the
    model at a peak of 1): exact for one and two chunks, an upper bound beyond."""
    chunks = len(next(iter(holdings)))
    highest = [max(h[c] for h in holdings) for c in range(chunks)]
    if any(h <= 0 for h in highest):
        return float("inf")
    alone = [1.0 / h for h in highest]  # each chunk's most, alone
    if chunks != 2:
        return sum(alone)
    corners = [(alone[0], 0.0), (0.0, alone[1])]
    for (a0, a1), (b0, b1) in combinations(holdings, 2):
        det = a0 * b1 - a1 * b0
        if abs(det) > _EPSILON:
            corners.append(((b1 - a1) / det, (a0 - b0) / det))
    feasible = [y for y in corners if min(y) >= -_EPSILON and all(h[0] * y[0] + h[1] * y[1] <= 1 + 1e-9 for h in holdings)]
    return max(y[0] + y[1] for y in feasible)

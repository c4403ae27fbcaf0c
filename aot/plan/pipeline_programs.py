"""The programs of a pipeline mesh, as the build makes them and the planner prices them: one
microbatch's forward traced and cut into stages where aot.plan.pipeline.split says, the schedule
checked, and every pipeline rank's step captured (aot/capture/pipeline.py) and finished by the
graph passes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from aot.capture.module_calls import layer_of
from aot.compile_step import Recording
from aot.passes import PassOptions, run_passes
from aot.capture.pipeline import Pipeline, capture_pipeline, draws_random
from aot.capture.stages import Stage, cut, trace_forward
from aot.capture.step import CapturedStep, Group, StepLayout
from aot.errors import AotError
from aot.plan.step_reading import analyze, node_seconds
from aot.plan.pipeline import check, schedule_actions, split
from runner.commands.formatting import human


# A pipeline's split search stops where its peaks would meet this far over the limit
# (_fit_split): no split fits, and recomputing the stages is tried next.
HOPELESS = 0.1


@dataclass
class PipelinePrograms:
    stages: list[Stage]
    actions: list[list]  # per pipeline rank (aot.plan.pipeline.Action)
    captures: list[CapturedStep]  # per pipeline rank, passes applied


@dataclass(frozen=True)
class Reporting:
    """Where pipeline_programs reports its work: `stage(title)`, a context around each part (a
    progress line), `note(line)`, a fact worth a line (which stages hold which layers), and
    `trying(line)`, said as each other split is captured to fit device memory (each as long as
    the programs' first capture: the planner says it)."""

    stage: Callable = lambda title: nullcontext()
    note: Callable = lambda line: None
    trying: Callable = lambda line: None


@dataclass(frozen=True)
class Schedule:
    """How a pipeline runs: its group, microbatches per step, the schedule's kind (gpipe | 1f1b |
    interleaved-1f1b | zero-bubble), stages per rank, and whether every stage's forward runs again
    in its backward (aot.capture.pipeline.run_stage)."""

    group: Group
    microbatches: int
    kind: str
    virtual: int = 1
    recompute: bool = False


def pipeline_programs(
    rec: Recording,
    layout: StepLayout,
    plan: Schedule,
    *,
    compute,
    passes: PassOptions,
    reporting: Reporting | None = None,
    memory_limit: float | None = None,
    forwards: dict | None = None,
) -> PipelinePrograms:
    """Every pipeline rank's program, through the graph passes (aot.passes.PASSES with `passes`);
    `reporting`: where progress goes (None: nowhere).

    `memory_limit`: bytes a pipeline rank may hold. Where the stages balanced by compute peak
    above it (1F1B's first ranks hold more microbatches in flight, the last holds the loss's
    logits), their boundaries move, one layer at a time, away from the rank that peaks (from any
    of its stages, interleaved), each split captured and its peaks read from the programs as built,
    until every rank fits or no move lowers the highest peak; the split with the lowest highest
    peak is kept. A model file's `pp_split` is kept as written.

    `forwards`: a cache of the traced microbatch forward by microbatch size, for callers that make
    the programs of one layout at several schedules (the planner: each schedule's programs are cut
    from the same forward, which cutting leaves as it is)."""
    reporting = reporting or Reporting()
    stage, note = reporting.stage, reporting.note
    forwards = {} if forwards is None else forwards
    mf, state, inputs, targets = rec.mf, rec.state, rec.inputs, rec.targets
    group, microbatches, schedule, virtual, recompute = plan.group, plan.microbatches, plan.kind, plan.virtual, plan.recompute
    pp, count = group.size, group.size * virtual
    size = targets.shape[0] // microbatches
    actions = schedule_actions(schedule, pp, microbatches, virtual)
    check(actions, microbatches, virtual)
    with stage(f"tracing one microbatch's forward and cutting it into {count} stages"):
        if size not in forwards:
            traced = trace_forward(mf, state, layout, [t[:size] for t in inputs], targets[:size])
            forwards[size] = (*traced, _weighted_layers(*traced))
        forward, sources, weighted = forwards[size]
    given = mf.globals.get("pp_split")

    def programs(starts: list[str] | None, trial: bool = False) -> tuple[list[Stage], list[CapturedStep], list[int]]:
        stage_of_layer = split(
            forward,
            count,
            lambda n: node_seconds(n, compute),
            layer_of,
            starts if starts is not None else given,
            where=f"{mf.path.name}: pp_split",
            weighted=weighted,
        )
        stages = cut(forward, sources, stage_of_layer, count)
        for r in range(pp):
            if not any(s.params for s in stages if s.index % pp == r):
                held = [layer for s in stages if s.index % pp == r for layer in s.layers]
                raise AotError(
                    f"pipeline rank {r} would hold no parameters (layers {', '.join(held)}): use fewer stages, "
                    f"or a pp_split that gives every rank a layer with weights"
                )
        if recompute and schedule == "zero-bubble":
            raise AotError(
                "--pp-schedule zero-bubble keeps each microbatch's activations until its weight gradients, and does not recompute "
                "stages; use --pp-schedule 1f1b to recompute, or give the build more device memory"
            )
        if recompute:
            for s in stages:
                drawn = draws_random(s.module)
                if drawn is not None:
                    raise AotError(
                        f"recomputing stages with pp: stage {s.index} ({_span(s.layers)}) draws random numbers ({drawn}, dropout?), "
                        f"which a recomputed forward would draw again differently; disable dropout or do not recompute"
                    )
        captures = []
        for r in range(pp):
            # a trial split's captures are the stage's own work, not steps of their own
            counts = {name: sum(a.kind == kind for a in actions[r]) for kind, name in (("F", "forward"), ("B", "backward"), ("W", "weight-gradient"))}
            counted = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
            title = f"capturing pipeline rank {r}'s step ({counted} actions) and running graph passes"
            with nullcontext() if trial else stage(title):
                pipeline = Pipeline(group, r, tuple(stages), microbatches, tuple(actions[r]), recompute)
                captured = capture_pipeline(mf, state, pipeline, layout, inputs, targets)
                captured.graph = run_passes(captured.graph, passes)
            captures.append(captured)
        peaks = [analyze(c.graph, c.slots).memory.peak for c in captures]
        if trial:
            note(f"stages beginning at {', '.join(s.layers[0] for s in stages[1:])}: highest predicted peak {max(peaks) / 2**20:.2f} MiB per rank")
        return stages, captures, peaks

    made = programs(None)
    if memory_limit is not None and given is None and max(made[2]) > memory_limit:
        made = _fit_split(programs, made, pp, memory_limit, note, reporting.trying)
    stages, captures, _ = made
    for s in stages:
        note(f"stage {s.index} on pipeline rank {s.index % pp}: {_span(s.layers)}, {sum(state.params[n].numel() for n in s.params):,} parameters")
    return PipelinePrograms(stages, actions, captures)


def _fit_split(programs, made: tuple, pp: int, limit: float, note, trying=lambda line: None) -> tuple:
    """Move stage boundaries away from the pipeline rank that peaks until every rank fits `limit`
    or no move lowers the highest peak: the (stages, captures, peaks) of the split whose highest
    peak is lowest, `made` (the balanced split's) if none is lower. Stage s runs on rank s % pp
    (one stage per rank, or interleaved), so a move from one of the peaking rank's stages hands a
    layer to a neighbouring stage on another rank. Each split tried is every rank's program
    captured (a minute for an 8B model): with one boundary, once the peaks the moves lead to meet
    more than HOPELESS over the limit (`_crossing`), the search stops there."""
    stages = made[0]
    order = [layer for s in stages for layer in s.layers]
    current = [order.index(s.layers[0]) for s in stages[1:]]  # where stages 1.. begin
    best, peaks, tried = made, made[2], {tuple(current)}
    while max(peaks) > limit:
        r = max(range(len(peaks)), key=peaks.__getitem__)
        moves = []  # (the receiving rank's peak, the new starts)
        for s in range(r, len(current) + 1, pp):
            if s > 0:  # the stage's first layer to the stage before
                moves.append((peaks[(s - 1) % pp], [*current[: s - 1], current[s - 1] + 1, *current[s:]]))
            if s < len(current):  # its last layer to the stage after
                moves.append((peaks[(s + 1) % pp], [*current[:s], current[s] - 1, *current[s + 1 :]]))
        for _, move in sorted(moves, key=lambda m: m[0]):  # toward the neighbour with room first
            bounds = [0, *move, len(order)]
            if tuple(move) in tried or any(a >= b for a, b in zip(bounds, bounds[1:])):
                continue
            tried.add(tuple(move))
            trying(f"over device memory ({human(max(peaks))} a rank, {human(limit)} allowed): trying stages beginning at {', '.join(order[i] for i in move)}")
            try:
                trial = programs([order[i] for i in move], trial=True)
            except AotError:
                continue  # a rank left without weights
            if max(trial[2]) < max(peaks):
                before, current, peaks = peaks, move, trial[2]
                if max(peaks) < max(best[2]):
                    best = trial
                break
        else:
            break  # no move lowers the highest peak
        crossing = _crossing(before, peaks) if len(current) == 1 else None
        if crossing is not None and crossing > (1 + HOPELESS) * limit:
            note(f"no split of the stages fits: moving layers one at a time, the peaks would meet at about {human(crossing)} a rank")
            break
    if best is not made:
        note(f"stages moved from the compute balance: the highest predicted peak {max(made[2]) / 2**20:.2f} -> {max(best[2]) / 2**20:.2f} MiB per rank")
    return best


def _crossing(before: list[int], after: list[int]) -> float | None:
    """Where the two ranks' peaks of a pipeline with one stage boundary would meet, moving one
    layer at a time as the move from `before` to `after` did: the stages are alike, so each layer
    moved lowers the one rank's peak and raises the other's by about as much as the first did.
    None where the move did not lower the one and raise the other, or the peaks have met."""
    high = max(range(2), key=before.__getitem__)
    low = 1 - high
    down, up = before[high] - after[high], after[low] - before[low]
    gap = after[high] - after[low]
    if down <= 0 or up < 0 or gap <= 0:
        return None
    return after[high] - down * gap / (down + up)


def _span(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{len(layers)} layers {layers[0]} .. {layers[-1]}"


def _weighted_layers(forward, sources) -> set[str]:
    """The layers whose ops read a parameter (directly, or through a view of it made elsewhere)."""
    params = {p for p, src in zip((n for n in forward.graph.nodes if n.op == "placeholder"), sources) if src.kind == "param"}
    found: set[str] = set()
    for node in forward.graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_of(node)
        if node.all_input_nodes and all(a in params for a in node.all_input_nodes) and layer is None:
            params.add(node)  # a weight's view outside any layer (DTensor unwraps slices at the top)
        elif layer is not None and any(a in params for a in node.all_input_nodes):
            found.add(layer)
    return found

"""Pipeline schedules and stage splits: which rank runs which microbatch's forward or backward of
which stage, in what order, and where the model is cut into stages.

A pipeline of `pp` ranks runs `pp * v` stages (v > 1: interleaved, each rank holds v model chunks,
the "looping" placement of torch.distributed.pipelining and Megatron: stage c * pp + r on rank r).
A schedule is, per rank, the list of actions its program performs, fixed at build: the build
unrolls it into the rank's program, so the runner never decides an order. Semantics and orders
follow torch.distributed.pipelining's schedules of the same names (GPipe: every forward, then every
backward; 1F1B and interleaved 1F1B: Megatron's warm-up, one-forward-one-backward steady state and
cool-down). `zero-bubble` is ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): each
backward is split into the gradient of the stage's inputs ("B", which the previous stage waits
for) and of its weights ("W", which nothing waits for), and the W actions fill the waits 1F1B
leaves, with no more microbatches in flight than 1F1B (one stage per rank).

`check` replays a schedule as the ranks would run it (a stage's forward needs the previous stage's
forward of that microbatch, its backward needs the next stage's backward) and refuses one that
deadlocks or leaves an action unrun.
"""

from __future__ import annotations

from dataclasses import dataclass

from aot.errors import AotError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True)
class Action:
    """One forward ("F"), backward ("B"; under zero-bubble its input gradients only) or weight
    gradient ("W", zero-bubble) of one microbatch through one of the rank's chunks."""

    kind: str
    microbatch: int
    chunk: int = 0

    def stage(self, rank: int, pp: int) -> int:
        return self.chunk * pp + rank

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def chunks_of(schedule: str, virtual: int | None) -> int:
    """Model chunks per rank: 1 for gpipe and 1f1b, `virtual` (default 2) for interleaved."""
    if schedule != "interleaved-1f1b":
        if virtual not in (None, 1):
            raise AotError(f"--pp-schedule {schedule} runs one stage per rank; --stages-per-rank {virtual} needs --pp-schedule interleaved-1f1b")
        return 1
    v = 2 if virtual is None else virtual
    if v < 2:
        raise AotError(f"--pp-schedule interleaved-1f1b needs at least 2 stages per rank, got {v}")
    return v


def check_microbatches(schedule: str, pp: int, microbatches: int, batch_size: int) -> None:
    """Refuse, in one line, microbatch counts the schedule or the batch cannot take."""
    if schedule not in SCHEDULES:
        raise AotError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if microbatches < 1:
        raise AotError(f"--microbatches must be at least 1, got {microbatches}")
    if batch_size % microbatches:
        raise AotError(f"--batch-size {batch_size} does not split into --microbatches {microbatches} equal microbatches")
    if schedule in ("1f1b", "interleaved-1f1b", "zero-bubble") and microbatches < pp:
        raise AotError(f"--pp-schedule {schedule} needs at least as many microbatches as pipeline ranks (pp={pp}), got --microbatches {microbatches}")
    if schedule == "interleaved-1f1b" and microbatches % pp:
        raise AotError(f"--pp-schedule interleaved-1f1b runs microbatches in groups of pp={pp}: --microbatches {microbatches} is not a multiple of {pp}")


def schedule_actions(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Every pipeline rank's actions, in the order its program runs them."""
    m = microbatches
    if schedule == "gpipe":
        return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]
    if schedule == "1f1b":
        ranks = []
        for r in range(pp):
            warmup = min(pp - r - 1, m)
            actions = [Action("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                actions += [Action("F", warmup + i), Action("B", i)]
            actions += [Action("B", i) for i in range(m - warmup, m)]
            ranks.append(actions)
        return ranks
    if schedule == "interleaved-1f1b":
        total = m * virtual

        def unit(k: int, backward: bool) -> Action:
            group, chunk = divmod(k, pp * virtual)
            chunk = chunk // pp
            mb = group * pp + k % pp
            return Action("B" if backward else "F", mb, virtual - 1 - chunk if backward else chunk)

        ranks = []
        for r in range(pp):
            warmup = min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
            actions = [unit(k, False) for k in range(warmup)]
            for i in range(total - warmup):
                actions += [unit(warmup + i, False), unit(i, True)]
            actions += [unit(k, True) for k in range(total - warmup, total)]
            ranks.append(actions)
        return ranks
    if schedule == "zero-bubble":
        return _zero_bubble(pp, m)
    raise AotError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")


def _zero_bubble(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1's orders, found by running the ranks in lock-step rounds with every action taking one
    round (F, B and W alike). Each rank runs, of what it can: a backward first (the previous stage
    waits for it); else a forward, while it has fewer than 1F1B's pp - rank microbatches between
    forward and backward and fewer than pp between forward and W (a W reads the microbatch's
    activations: every rank holds at most the pp microbatches 1F1B's first rank holds); else its
    oldest pending W. The W's so fill the rounds where 1F1B's ranks wait."""
    done: set = set()  # (kind, microbatch, rank)
    orders: list[list[Action]] = [[] for _ in range(pp)]
    count = {kind: [0] * pp for kind in "FBW"}
    while any(w < m for w in count["W"]):
        chosen = []
        for r in range(pp):
            f, b, w = (count[kind][r] for kind in "FBW")
            if b < f and (r == pp - 1 or ("B", b, r + 1) in done):
                chosen.append((r, Action("B", b)))
            elif f < m and f - b < pp - r and f - w < pp and (r == 0 or ("F", f, r - 1) in done):
                chosen.append((r, Action("F", f)))
            elif w < b:
                chosen.append((r, Action("W", w)))
        for r, action in chosen:
            done.add((action.kind, action.microbatch, r))
            orders[r].append(action)
            count[action.kind][r] += 1
    return orders


def unit_step(actions: list[list[Action]]) -> float:
    """The step of a one-stage-per-rank schedule whose forward, input-gradient and weight-gradient
    passes each take one unit (a backward not split in two: two units), transfers free."""
    pp = len(actions)
    split = any(a.kind == "W" for acts in actions for a in acts)
    cost = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    clock, position = [0.0] * pp, [0] * pp
    finished: dict[tuple, float] = {}
    while any(position[r] < len(actions[r]) for r in range(pp)):
        before = sum(position)
        for r in range(pp):
            while position[r] < len(actions[r]):
                a = actions[r][position[r]]
                need = ("F", a.microbatch, r - 1) if a.kind == "F" and r > 0 else ("B", a.microbatch, r + 1) if a.kind == "B" and r < pp - 1 else None
                if need is not None and need not in finished:
                    break
                clock[r] = max(clock[r], finished[need] if need else 0.0) + cost[a.kind]
                finished[(a.kind, a.microbatch, r)] = clock[r]
                position[r] += 1
        if sum(position) == before:  # a schedule `check` would refuse
            raise AotError("pipeline schedule deadlocks")
    return max(clock)


def check(actions: list[list[Action]], microbatches: int, virtual: int = 1) -> int:
    """Replay the schedule: every rank runs its actions in order, an action waiting until what it
    receives was sent. Returns the number of rounds (a round: every rank that can, runs its next
    action); refuses a schedule that deadlocks, repeats or misses an action."""
    pp = len(actions)
    stages = pp * virtual
    kinds = "FBW" if any(a.kind == "W" for acts in actions for a in acts) else "FB"
    for r, acts in enumerate(actions):
        expected = {(k, mb, c) for k in kinds for mb in range(microbatches) for c in range(virtual)}
        got = [(a.kind, a.microbatch, a.chunk) for a in acts]
        if len(got) != len(set(got)) or set(got) != expected:
            what = "forward, backward and weight gradient" if kinds == "FBW" else "forward and backward"
            raise AotError(f"pipeline schedule: rank {r} does not run each microbatch's {what} once")
    done: set = set()  # (kind, microbatch, stage)
    position = [0] * pp
    rounds = 0
    while any(p < len(a) for p, a in zip(position, actions)):
        ready = []
        for r in range(pp):
            if position[r] == len(actions[r]):
                continue
            a = actions[r][position[r]]
            s = a.stage(r, pp)
            if a.kind == "F":
                ok = s == 0 or ("F", a.microbatch, s - 1) in done
            elif a.kind == "W":
                ok = ("B", a.microbatch, s) in done
            else:
                ok = ("F", a.microbatch, s) in done and (s == stages - 1 or ("B", a.microbatch, s + 1) in done)
            if ok:
                ready.append((r, (a.kind, a.microbatch, s)))
        if not ready:
            stuck = ", ".join(f"rank {r} at {actions[r][position[r]]}" for r in range(pp) if position[r] < len(actions[r]))
            raise AotError(f"pipeline schedule deadlocks: {stuck}")
        for r, key in ready:
            done.add(key)
            position[r] += 1
        rounds += 1
    return rounds


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step with equal stages: (p - 1) / (v m + p - 1) (GPipe and 1F1B: v = 1).
    Zero-bubble's, with forward, input-gradient and weight-gradient passes of equal time, from its
    orders (unit_step): 5/29 at pp=4 and 8 microbatches, where 1F1B's is 9/33."""
    if schedule == "zero-bubble":
        return 1 - 3 * microbatches / unit_step(_zero_bubble(pp, microbatches))
    v = virtual if schedule == "interleaved-1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def bubble_floor(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """A lower bound of bubble_fraction that costs nothing to compute (zero-bubble's exact share
    simulates its orders: seconds at thousands of ranks). Zero-bubble's last rank waits at least
    for the first forward to cross pp - 1 stages, each a third of a microbatch's work (F, B and W
    equal): (pp - 1) / (3 m + pp - 1). The other schedules' shares are already closed forms."""
    if schedule == "zero-bubble":
        return (pp - 1) / (3 * microbatches + pp - 1)
    return bubble_fraction(schedule, pp, microbatches, virtual)


def balance(costs: list[float], parts: int) -> list[int]:
    """Cut a sequence of layers into `parts` contiguous runs minimizing the costliest run: the
    index where each run after the first begins (parts - 1 indices)."""
    n = len(costs)
    if parts > n:
        raise AotError(f"cannot cut {n} layer(s) into {parts} pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the least possible max cost cutting the first i layers into k runs
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)[1:]


def split(graph, stages: int, seconds, layer_of, pp_split: list[str] | None = None, where: str = "pp_split", weighted: set | None = None) -> dict[str, int]:
    """Each layer's stage: where the model file's `pp_split` (module names that begin stages 1, 2,
    ...) says, else contiguous runs of layers balanced by the cost model's forward seconds
    (`seconds(node)`; what comes before the first layer counts with it, what follows the last with
    the last). `weighted`: the layers with parameters; a layer without (an activation of a
    Sequential) stays with the layer before it, so no stage is left without weights."""
    order: list[str] = []
    cost: dict[str, float] = {}
    pending = 0.0
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_of(node)
        if layer is None:
            if order:
                cost[order[-1]] += seconds(node)
            else:
                pending += seconds(node)
            continue
        if layer not in cost:
            order.append(layer)
            cost[layer] = pending if len(order) == 1 else 0.0
        cost[layer] += seconds(node)
    if not order:
        raise AotError(
            "pipeline parallelism cuts the model between layers (the children of an nn.ModuleList or "
            "nn.Sequential, such as blocks.0, blocks.1), and this model's forward calls none"
        )
    if len(order) < stages:
        raise AotError(
            f"pipeline: {stages} stages need at least {stages} layers; the model has {len(order)} ({', '.join(order[:6])}{', ...' if len(order) > 6 else ''})"
        )
    if pp_split is not None:
        if not isinstance(pp_split, (list, tuple)) or not all(isinstance(n, str) for n in pp_split):
            raise AotError(f'{where} must be a list of module names where stages 1, 2, ... begin, such as ["blocks.4"]')
        missing = [n for n in pp_split if n not in order]
        if missing:
            raise AotError(
                f"{where} names {missing[0]!r}, which is not a layer of the model (layers: {', '.join(order[:6])}{', ...' if len(order) > 6 else ''})"
            )
        if len(pp_split) != stages - 1:
            raise AotError(f"{where} names {len(pp_split)} module(s) for {stages} stages: it needs {stages - 1}")
        starts = [order.index(n) for n in pp_split]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise AotError(f"{where} must name layers in forward order, after the first layer ({order[0]})")
    else:
        # runs of layers that start at a weighted layer (the first run also takes what precedes it)
        heads = [i for i, layer in enumerate(order) if weighted is None or layer in weighted or i == 0]
        if len(heads) < stages:  # too few: cut between any layers (a rank must still hold some weights)
            heads = list(range(len(order)))
        groups = [order[a:b] for a, b in zip(heads, [*heads[1:], len(order)])]
        cuts = balance([sum(cost[layer] for layer in g) for g in groups], stages)
        starts = [heads[c] for c in cuts]
    bounds = [0, *starts, len(order)]
    return {layer: k for k in range(stages) for layer in order[bounds[k] : bounds[k + 1]]}

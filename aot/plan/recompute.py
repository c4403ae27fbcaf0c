"""What a build recomputes: the user's request (a memory budget, an activation budget or a
model-file policy) turned into a choice for aot.passes.recompute, priced by the cost model.

A memory budget is met by the least recomputation whose predicted peak (graph liveness, after
every other pass) is under it: activation budgets from 1.0 down to the smallest feasible one are
tried in steps of 1/GRID. A budget no recomputation reaches is refused with the smallest peak
there is, and so is an activation budget below the smallest feasible one. The default budget (the
device's memory) is not the user's demand: there the build takes the smallest peak and warns.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace
from typing import Callable

import torch

from aot.errors import AotError
from aot.passes.graph_utils import copy_graph, lint_once
from aot.passes.recompute import Choice, budget_choices, by_budget, by_checkpoint_calls, by_modules, has_checkpoint_calls, recompute_activations
from aot.plan.step_reading import node_seconds, peak_memory
from runner.commands.formatting import human

GRID = 10  # a memory budget tries activation budgets 0.9, 0.8, ... down to the smallest feasible


@dataclass(frozen=True)
class Request:
    """`memory_bytes` (per rank), `fraction` (of saved activation bytes kept) or module
    `patterns` (checkpoint each call; `save_matmuls`: selective) or the model's own
    torch.utils.checkpoint calls (`checkpoint_calls`); `source` says who asked."""

    memory_bytes: int | None = None
    fraction: float | None = None
    patterns: tuple = ()
    save_matmuls: bool = False
    checkpoint_calls: bool = False
    source: str = "none"

    @property
    def none(self) -> bool:
        return self.memory_bytes is None and self.fraction is None and not self.patterns and not self.checkpoint_calls


_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_memory(text: str) -> int:
    """`80`, `80GiB`, `512MiB`, `1.5GB` -> bytes (a bare number is GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise AotError(f"--memory-budget must be a positive size such as 70, 70GiB or 512MiB (a bare number is GiB), got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_request(
    memory_budget: str | None,
    activation_budget: float | None,
    model_globals: dict,
    name: str,
    device_memory: int | None,
    headroom: float,
    fraction_source: str = "--activation-budget",
) -> Request:
    """The flags win over the model file's `recompute`; with neither, the profile's device memory
    (less the planner's headroom) is the budget, so a step that fits recomputes nothing."""
    if memory_budget is not None and activation_budget is not None:
        raise AotError("--memory-budget and --activation-budget both say how much to recompute: give one")
    if activation_budget is not None:
        if not 0.0 <= activation_budget <= 1.0:
            raise AotError(f"--activation-budget is the fraction of saved activations kept, from 0 to 1; got {activation_budget}")
        return Request(fraction=activation_budget, source=fraction_source)
    if memory_budget is not None:
        return Request(memory_bytes=parse_memory(memory_budget), source="--memory-budget")
    policy = (model_globals or {}).get("recompute")
    if policy is not None:
        return _model_file_policy(policy, name)
    if device_memory:
        return Request(memory_bytes=int(headroom * device_memory), source="device memory")
    return Request()


def _model_file_policy(policy, name: str) -> Request:
    where = f"{name}: recompute"
    if isinstance(policy, str):
        policy = [policy]
    if isinstance(policy, (list, tuple)):
        policy = {"modules": list(policy)}
    if not isinstance(policy, dict) or set(policy) - {"modules", "save"}:
        raise AotError(f'{where} must be a list of module name patterns (["blocks.*"]) or {{"modules": [...], "save": "matmuls"}}; got {policy!r}')
    modules = policy.get("modules")
    if not modules or not isinstance(modules, (list, tuple)) or not all(isinstance(p, str) and p for p in modules):
        raise AotError(f'{where}: "modules" must be a non-empty list of module name patterns such as "blocks.*"')
    save = policy.get("save", "nothing")
    if save not in ("nothing", "matmuls"):
        raise AotError(f'{where}: "save" must be "matmuls" (selective: matmul outputs kept) or "nothing"; got {save!r}')
    return Request(patterns=tuple(modules), save_matmuls=save == "matmuls", source="model file")


def apply_request(
    gm: torch.fx.GraphModule, slots: list, request: Request, compute, finish: Callable[[torch.fx.GraphModule], torch.fx.GraphModule]
) -> tuple[torch.fx.GraphModule, dict]:
    """The step with `request`'s recomputation and the other passes (`finish`) applied, and what
    was chosen (the manifest's `memory.recompute`)."""
    cost = lambda n: node_seconds(n, compute)
    if request.source in ("none", "device memory") and has_checkpoint_calls(gm.graph):
        # no flag or model-file `recompute` says otherwise: the model's checkpoint calls are the request
        request = Request(checkpoint_calls=True, source="torch.utils.checkpoint")
        choice = by_checkpoint_calls(gm.graph, cost)
        return finish(recompute_activations(gm, choice)), _summary(request, choice)
    if request.none:
        return finish(gm), _summary(request, None)
    if request.patterns:
        choice = by_modules(gm.graph, request.patterns, request.save_matmuls, cost)
        if not choice.values:
            raise AotError(
                f"recompute {list(request.patterns)}: no module call matching these patterns keeps a value "
                f"backward reads (module names are dotted paths from the model, e.g. blocks.*)"
            )
        return finish(recompute_activations(gm, choice)), _summary(request, choice)
    if request.fraction is not None:
        choice = by_budget(gm.graph, request.fraction, cost)
        if choice.kept_bytes > request.fraction * choice.saved_bytes:
            raise AotError(
                f"--activation-budget {request.fraction:g} is below what recomputation can reach here: the smallest "
                f"feasible is {smallest_fraction(choice.fraction):.3f} (the step's inputs, layer boundaries and random draws stay saved)"
            )
        return finish(recompute_activations(gm, choice)), _summary(request, choice)
    return _fit(gm, slots, request, cost, finish)


def _fit(gm, slots, request: Request, cost, finish):
    def attempt(chosen: Choice | None):
        copies: dict = {}
        trial = copy_graph(gm, copies)
        # the choice made on gm's graph, on the copy's nodes
        choice = None if chosen is None else replace(chosen, nodes={copies[n] for n in chosen.nodes}, kept=set(), pinned=set())
        with lint_once():  # finish (run_passes) lints the step once, after the recomputation and every pass
            trial = finish(recompute_activations(trial, choice) if choice else trial)
        return trial, choice, peak_memory(trial, slots)

    budget = request.memory_bytes
    assert budget is not None  # apply_request comes here only for a memory budget
    trial, _, peak = attempt(None)
    if peak <= budget:
        return trial, {**_summary(request, None), "peak_without_recompute": peak}
    # Budgets are tried on a grid, the least recomputation that fits wins. Each try runs every pass
    # over the whole step (seconds at DeepSeek-V3 size), so the peaks are predicted from the tries
    # made (least_fitting) and only points that may fit are tried.
    choose = budget_choices(gm.graph, cost)
    most = choose(0.0)
    grid = [f / GRID for f in range(GRID - 1, 0, -1) if f / GRID > most.fraction] + [most.fraction]
    tries = functools.cache(lambda i: attempt(choose(grid[i])))
    freed = [most.saved_bytes - choose(fraction).kept_bytes for fraction in grid]
    found = least_fitting(freed, peak, budget, lambda i: tries(i)[2])
    if found is not None:
        trial, choice, _ = tries(found)
        return trial, {**_summary(request, choice), "peak_without_recompute": peak}
    # None fits: every point is tried for the smallest peak there is (the peak is not monotone in the
    # recomputation: its transient rebuilds add to it, and the most recomputation was measured 3%
    # above a point between on a DeepSeek-V3-like step at 64 ranks)
    tried = [tries(i) for i in range(len(grid))]
    smallest = min(peak, *(t[2] for t in tried))
    if request.source == "device memory":  # not the user's demand: build the smallest peak there is, and say so
        trial, choice, candidate = min(tried, key=lambda t: t[2])
        return trial, {
            **_summary(request, choice),
            "peak_without_recompute": peak,
            "fits": False,
            "warning": f"the step needs {human(candidate)} per rank even recomputing activations (without: "
            f"{human(peak)}), more than the device's {human(budget)} after headroom: it may run out "
            f"of memory; use more ranks, fsdp, or a smaller batch",
        }
    raise AotError(
        f"--memory-budget {human(budget)} is below the smallest peak recomputation reaches for this step, "
        f"{human(smallest)} per rank (without recomputation: {human(peak)})"
    )


def least_fitting(freed: list[int], peak: int, budget: int, measure: Callable[[int], int]) -> int | None:
    """The grid point with the least recomputation (lowest index; `freed[i]`, the activation bytes
    point i stops keeping, grows with i) whose measured peak meets `budget`, or None; `peak` is the
    peak without recomputation. A point is measured only where the peaks known so far, linear in the
    bytes freed between them (past the last, along the last two; before any, byte for byte: the
    most a freed byte can lower the peak), say it may fit; where none may, the most recomputation
    is measured once. So a point is passed over only where the measured points around it say it
    misses: with a peak falling linearly, this is what trying every point from the top finds, in
    two to four measurements instead of up to ten (and None after at most a few)."""
    known: dict[int, int] = {}

    def predicted(i: int) -> float:
        points = sorted([(0, peak), *((freed[j], p) for j, p in known.items())])
        below = max((q for q in points if q[0] <= freed[i]), default=points[0])
        above = min((q for q in points if q[0] > freed[i]), default=None)
        if above is None:  # past the last point measured: along the last two (byte for byte from the first)
            before = max((q for q in points if q[0] < below[0]), default=None)
            slope = 1.0 if before is None else (before[1] - below[1]) / (below[0] - before[0])
            return below[1] - slope * (freed[i] - below[0])
        return below[1] + (above[1] - below[1]) * (freed[i] - below[0]) / (above[0] - below[0])

    while True:
        fitting = min((i for i, p in known.items() if p <= budget), default=None)
        open_ = [i for i in range(len(freed) if fitting is None else fitting) if i not in known]
        if not open_:
            return fitting
        hopeful = [i for i in open_ if predicted(i) <= budget]
        if not hopeful and (fitting is not None or len(freed) - 1 in known):
            return fitting  # no point left that the measured ones say may fit
        i = hopeful[0] if hopeful else len(freed) - 1
        known[i] = measure(i)


def _summary(request: Request, choice: Choice | None) -> dict:
    policy = "none" if choice is None else "modules" if request.patterns else "checkpoint_calls" if request.checkpoint_calls else "budget"
    summary: dict[str, object] = {"policy": policy, "source": request.source}
    if request.memory_bytes is not None:
        summary["memory_budget_bytes"] = request.memory_bytes
    if request.fraction is not None:
        summary["activation_budget"] = request.fraction
    if request.patterns:
        summary["modules"] = list(request.patterns)
        summary["save"] = "matmuls" if request.save_matmuls else "nothing"
    if choice is not None:
        summary.update(
            saved_activation_bytes=choice.saved_bytes,
            kept_activation_bytes=choice.kept_bytes,
            recomputed_values=choice.values,
            recomputed_ops=len(choice.nodes),
            predicted_recompute_s=choice.cost_s,
        )
    return summary


def smallest_fraction(least: float) -> float:
    """The smallest feasible activation budget (by_budget(graph, 0).fraction) rounded up to a
    thousandth: a budget `aot build --activation-budget` reaches, as messages and plans state it."""
    return math.ceil(round(least * 1000, 6)) / 1000

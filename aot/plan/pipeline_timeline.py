"""The predicted step of a pipeline: every pipeline rank's program run side by side.

A pipeline rank's program alone does not say how long a step takes: its receives wait for other
ranks' sends, so the bubble is where the programs meet. Each program is walked in its own order
on its own clock: an op costs the cost model's seconds (aot.plan.step_reading.node_seconds); a
send is issued at once (the transfer runs beside compute); the wait for a receive ends no earlier
than the peer's send of the same tag was issued plus the transfer (alpha + bytes x beta over the
link the placement gives the two ranks: the calibration's point-to-point line where the profile
has one, `send_recv`, else the link's); the wait for a send ends no earlier than the peer
issued its receive. A collective over the rank's data axes costs what the collective model says
(added to the clock where communication does not overlap compute, else ending at issue + cost);
one over the pipeline group ends when the last pipeline rank issues it, plus its cost. Ranks are
advanced in turn until each is blocked or done; a schedule that passes aot.plan.pipeline.check
always finishes.

Where communication does not overlap compute (CPU ranks), each blocking wait on another rank (a
receive, a collective) also pays the calibrated in-step stall, as a step without pp pays it for
its collectives (aot.plan.cost_model.simulate): the programs are walked once to find the compute
before each such wait, each rank's stall for all of them is the device model's `blocking_stall`
(the median step's), and the walk is repeated with that spread evenly over the rank's waits.
Without it pipelines on CPU ranks were priced 29-49% under their measured steps while dp was
priced within 15%, so the planner favoured pipelines there (bench/pipeline.py at e605b0c;
with it, BENCHMARKS.md "Pipeline parallelism": 13-26% under).

The result: the step (the last rank's end), each rank's busy and waiting seconds, and a Chrome
trace with one thread per pipeline rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aot.plan.collectives import SEND_RECV
from aot.plan.step_reading import analyze, node_seconds
from aot.plan.placement import Placement
from runner.format.axes import PP

_funcol = torch.ops._c10d_functional
P2P = {_funcol.isend.default: "send", _funcol.irecv.default: "recv"}


@dataclass
class RankClock:
    nodes: list
    position: int = 0
    t: float = 0.0
    busy: float = 0.0
    computed: float = 0.0  # busy seconds when it last waited on communication
    segments: list = field(default_factory=list)  # (compute since the last such wait, kind) at each
    waiting: float = 0.0
    events: list = field(default_factory=list)
    handles: dict = field(default_factory=dict)  # p2p or collective node -> what its wait needs

    @property
    def done(self) -> bool:
        return self.position >= len(self.nodes)


@dataclass
class PipelineTimeline:
    step_s: float
    busy_s: list[float]  # per pipeline rank: seconds computing (and on blocking collectives)
    waiting_s: list[float]  # per pipeline rank: seconds blocked on another rank
    trace: dict


def simulate_pipeline(programs: list[torch.fx.GraphModule], planner, placement: Placement, group: str) -> PipelineTimeline:
    """`programs[r]`: pipeline rank r's program (the graph as built); `planner` prices collectives
    (aot.plan.search.Planner), `placement` says where the ranks are, `group` names the pipeline group."""
    machine = planner.machine
    pp = len(programs)
    physical = placement.groups(PP)[0]  # pipeline ranks 0..pp-1 of the first replica (all are alike)
    pricers = []
    for gm in programs:
        step = analyze(gm)
        cost, _ = planner.comm_pricer(placement, step.comms)
        pricers.append(({c.name: c for c in step.comms}, cost))

    def transfer(a: int, b: int, nbytes: int) -> float:
        link = machine.span(sorted([physical[a], physical[b]]), SEND_RECV).flat()
        return link.alpha + nbytes * link.beta

    def walk(stall: list[float]) -> list[RankClock]:
        """Every rank's program on its clock; `stall[r]`: what each of rank r's blocking waits on
        communication pays beyond it (each records the compute before it in `clock.segments`)."""
        clocks = [RankClock([n for n in gm.graph.nodes if n.op == "call_function"]) for gm in programs]
        sent: dict = {}  # (src, dst, tag) -> the sender's issue time
        posted: dict = {}  # (src, dst, tag) -> the receiver's issue time
        arrivals: dict = {}  # k -> issue times of the k-th pipeline-group collective, per rank that issued it
        counters = [0] * pp  # pipeline-group collectives issued so far, per rank

        def advance(r: int) -> bool:
            """Run rank r until it blocks or ends; whether it moved."""
            clock, (sites, cost) = clocks[r], pricers[r]
            moved = False
            while not clock.done:
                node = clock.nodes[clock.position]
                handle = clock.handles.get(node.args[0]) if node.target is _funcol.wait_tensor.default and node.args else None
                if handle is not None:
                    kind = handle[0]
                    if kind == "recv":
                        _, peer, tag, nbytes = handle
                        if (peer, r, tag) not in sent:
                            return moved
                        _met(clock, SEND_RECV)
                        _wait(clock, max(clock.t, sent[(peer, r, tag)] + transfer(peer, r, nbytes)) + stall[r], f"wait for rank {peer}")
                    elif kind == "send":
                        _, peer, tag, _ = handle
                        if (r, peer, tag) not in posted:
                            return moved
                        _wait(clock, posted[(r, peer, tag)], f"wait for rank {peer}")
                    elif kind == PP:  # ends once every pipeline rank has issued it
                        _, index, seconds, collective = handle
                        if len(arrivals.get(index, ())) < pp:
                            return moved
                        _met(clock, collective)
                        _wait(clock, max(clock.t, max(arrivals[index]) + seconds) + stall[r], "pipeline all_reduce")
                    else:
                        _wait(clock, handle[1], "collective")
                elif node.target in P2P:
                    kind, peer, tag = P2P[node.target], int(node.args[1]), int(node.args[2])
                    val = node.args[0].meta.get("val")
                    nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
                    if kind == "send":
                        sent[(r, peer, tag)] = clock.t
                    else:
                        posted[(peer, r, tag)] = clock.t
                    clock.handles[node] = (kind, peer, tag, nbytes)
                elif node.name in sites:
                    site = sites[node.name]
                    seconds = cost(site)[1]
                    if site.group == group:
                        arrivals.setdefault(counters[r], []).append(clock.t)
                        clock.handles[node] = (PP, counters[r], seconds, site.kind)
                        counters[r] += 1
                    elif planner.overlaps:
                        clock.handles[node] = ("local", clock.t + seconds)
                    else:  # CPU ranks: communication does not overlap compute (aot.plan.search)
                        _met(clock, site.kind)
                        _run(clock, seconds + stall[r])
                else:
                    _run(clock, node_seconds(node, machine.compute))
                clock.position += 1
                moved = True
            return moved

        while not all(c.done for c in clocks):
            if not any(advance(r) for r in range(pp)):
                stuck = ", ".join(f"rank {r} at {c.nodes[c.position].name}" for r, c in enumerate(clocks) if not c.done)
                raise RuntimeError(f"pipeline timeline: the programs wait on each other ({stuck})")
        return clocks

    clocks = walk([0.0] * pp)
    if not planner.overlaps:  # CPU ranks: each blocking wait pays the calibrated in-step stall
        stalls = [machine.compute.blocking_stall(*zip(*c.segments)) / len(c.segments) if c.segments else 0.0 for c in clocks]
        if any(stalls):
            clocks = walk(stalls)
    step_s = max(c.t for c in clocks)
    return PipelineTimeline(step_s, [c.busy for c in clocks], [c.waiting + step_s - c.t for c in clocks], _trace(clocks, step_s))


def _met(clock: RankClock, kind: str) -> None:
    """A blocking wait on communication: the compute before it sets its stall (aot.plan.device_model)."""
    clock.segments.append((clock.busy - clock.computed, kind))
    clock.computed = clock.busy


def _run(clock: RankClock, seconds: float) -> None:
    if seconds <= 0:
        return
    _merge(clock, "run", "compute", clock.t, seconds)
    clock.t += seconds
    clock.busy += seconds


def _wait(clock: RankClock, ready: float, name: str) -> None:
    if ready > clock.t:
        _merge(clock, "wait", name, clock.t, ready - clock.t)
        clock.waiting += ready - clock.t
        clock.t = ready


def _merge(clock: RankClock, lane: str, name: str, start: float, seconds: float) -> None:
    """Consecutive compute ops become one event (a trace of every op of a long pipeline is huge)."""
    last = clock.events[-1] if clock.events else None
    if last and last[0] == lane == "run" and abs(last[2] + last[3] - start) < 1e-12:
        clock.events[-1] = ("run", "compute", last[2], last[3] + seconds)
    else:
        clock.events.append((lane, name if lane == "wait" else "compute", start, seconds))


def _trace(clocks: list[RankClock], step: float) -> dict:
    events = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "predicted pipeline step (one replica)"}}]
    for r, clock in enumerate(clocks):
        events.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": f"pipeline rank {r}"}})
        for lane, name, start, seconds in clock.events:
            events.append({"ph": "X", "pid": 0, "tid": r, "name": name, "cat": lane, "ts": round(start * 1e6, 3), "dur": round(seconds * 1e6, 3)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"predicted_step_s": step, "busy_s": [c.busy for c in clocks], "waiting_s": [c.waiting + step - c.t for c in clocks]},
    }

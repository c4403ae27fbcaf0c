"""`aot run --profile DIR`: the measured timeline of a few steps, beside the plan's predicted one.

torch.profiler records up to 5 steps after one warm-up step (so start-up costs stay out); the step
time reported is the median of the steps after that window, which run without profiler overhead.
Rank 0 writes DIR/measured_timeline.json (a Chrome trace, like the artifact's predicted
plan/timeline.json) and DIR/profile.json: per step, the measured wall time, the time the program
sat waiting for collectives (`_c10d_functional::wait_tensor`, the communication compute did not
hide) and the rest (compute). `aot inspect ARTIFACT --profile DIR` puts them next to the plan's
prediction.

The first step of the run (the warm-up step, whose time no summary uses) also measures each rank's
peak memory (runner/execution/memory_tracking.py); the peaks are gathered to rank 0 and written under
"memory" in DIR/profile.json.

Pipeline ranks (an artifact with `pipeline`, `pipeline=True`; CPU ranks on gloo) also measure the pipeline's wait,
the bubble as a rank sees it: the time its `wait_tensor` calls spent waiting for a stage transfer,
split into waits for a receive (`irecv`: a neighbour stage has not sent yet) and waits for a send
(`isend`, waited at the end of the step: the peer has not received yet), and the rest of its waits
(collectives: the end-of-step all_reduce over the pipeline group, where the last stage waits for
the others to drain, and data-parallel reductions). Which transfer a wait waited for is read from
the profiler's own events, without marking anything at step time: gloo records each send and
receive as a `gloo:send` / `gloo:recv` range that opens when the transfer is issued and closes
when its work is finished, and a point-to-point work is finished inside its `wait()` (gloo's
SendWork/RecvWork complete only when waited; nothing else waits them: runner/execution/p2p.py's send
kernel and torch's receive kernel register the work for `wait_tensor` alone). So the one
`wait_tensor` event (on the step's thread; they never overlap) that a `gloo:recv` range ends
inside waited for that receive, likewise for sends; a wait no such range ends in waited for a
collective (gloo's collective ranges end on its worker thread, at completion, and are not read).
Every pipeline rank finds its waits per profiled step (the steps `ProfilerStep#k` delimits, whose
durations are that rank's profiled step times) and the sums are gathered to rank 0 as one float64
all_gather (nothing pickled, like the memory peaks), which writes them to profile.json:
`p2p_wait_s` (rank 0's median over profiled steps, receive + send waits), `p2p_recv_wait_s`,
`p2p_send_wait_s`, `p2p_wait_s_per_step`, and under `pipeline_wait.per_rank` each rank's medians
(`step_s`: its profiled step; `p2p_wait_s`, `recv_wait_s`, `send_wait_s`, `collective_wait_s`;
`p2p_share` and `wait_share`: the median over steps of that step's p2p wait, resp. all its waits,
over its duration) and its per-step lists. The profiled steps run under the profiler, slower than
the steps `step_s` is taken from, so shares compare a wait with the step it was measured in. On
CUDA ranks wait_tensor only makes a stream wait (the host does not sit idle), so nothing is
measured there; the keys are absent, as they are for artifacts without a pipeline.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.execution.memory_tracking import ALLOCATOR
from runner.execution.memory_tracking import method as memory_method

SUMMARY = "profile.json"
TRACE = "measured_timeline.json"
WARMUP_STEPS = 1
WAIT = "_c10d_functional::wait_tensor"
ISSUE = (
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single",
)
STEP = "ProfilerStep"  # events() names them "ProfilerStep*", the trace "ProfilerStep#k"
# gloo's profiling titles of a point-to-point work (ProcessGroupGloo: "gloo:send", "gloo:recv",
# "gloo:recvAnySource"), by the kind of wait that finishes them
P2P_RANGES = (("gloo:recv", "recv"), ("gloo:send", "send"))
WAIT_KINDS = ("recv", "send", "collective")


class StepProfiler:
    """Wrap the step loop: `with StepProfiler(dir, steps, rank, device) as p: ... p.step(seconds)`."""

    def __init__(self, folder: Path | None, steps: int, rank: int, device: torch.device, tier: str, pipeline: bool = False):
        self.folder, self.rank, self.tier = folder, rank, tier
        self.pipeline = pipeline  # the artifact is a pipeline: measure its waits for stage transfers
        self.active = max(0, min(steps - WARMUP_STEPS, 5))
        self.seconds: list[float] = []  # the profiled steps
        self.after: list[float] = []  # steps after the profiled window: no profiler overhead
        self._seen = 0
        self._prof = None
        self.memory: dict | None = None  # "memory" of profile.json, once measured
        self._device = device
        # The compiled tier's memory step runs its own profiler (allocator events), which cannot
        # run inside this one: this one then starts right after that step, as it would have left
        # its warm-up (so the same steps are profiled).
        self._deferred = False
        self._entered = False
        if folder is not None and self.active:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=WARMUP_STEPS, active=self.active, repeat=1)
            )
            self._deferred = memory_method(device, tier) == ALLOCATOR

    @property
    def measuring_memory(self) -> bool:
        """Whether the next step should measure its peak memory: the warm-up step of a profiled run.
        Every rank gives the same answer, so every rank joins `record_memory`'s gather."""
        return self._prof is not None and self._seen == 0

    def record_memory(self, peak: int | None, method: str, step: int) -> None:
        """Every rank's `peak` (bytes, None if not measured; `method` says how) of step `step`,
        gathered to rank 0. A collective: call it on every rank, right after the measured step."""
        peaks = gather_peaks(peak, self._device)
        self.memory = {
            "measured_peak_bytes": peaks if all(p is not None for p in peaks) else None,
            "method": method,
            "step": step,
        }

    def __enter__(self):
        if self._prof is not None and not self._deferred:
            self._prof.__enter__()
            self._entered = True
        return self

    def step(self, seconds: float) -> None:
        if self._prof is None:
            return
        self._seen += 1
        if self._deferred and self._seen == WARMUP_STEPS:
            self._prof.__enter__()  # prepares the trace (its warm-up); the step() below starts it
            self._entered = True
        if WARMUP_STEPS < self._seen <= WARMUP_STEPS + self.active:
            self.seconds.append(seconds)
        elif self._seen > WARMUP_STEPS + self.active:
            self.after.append(seconds)
        self._prof.step()

    def __exit__(self, *exc) -> None:
        if not self._entered:
            return
        prof, folder = self._prof, self.folder
        assert prof is not None and folder is not None  # entered: __init__ made a profiler, having a folder
        prof.__exit__(*exc)
        if exc[0] is not None or not self.seconds:
            return
        # Every rank of a pipeline joins the gather of its waits (a collective); the others'
        # events are read there, rank 0's below.
        pipeline = None
        # every rank of a pipeline answers alike, so all join the gather
        if self.pipeline and self._device.type == "cpu" and dist.is_initialized():
            pipeline = gather_waits(step_waits(prof.events(), len(self.seconds)), self._device)
        if self.rank != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / TRACE))
        events = prof.events()
        per_step = lambda names: sum(e.cpu_time_total for e in events if e.name in names) / 1e6 / len(self.seconds)
        # The profiler slows every op down; steps after its window give the step time without it.
        step_s = statistics.median(self.after or self.seconds)
        waited = per_step((WAIT,))
        summary = {
            "steps_profiled": len(self.seconds),
            "tier": self.tier,
            "step_s": step_s,
            "step_s_source": "steps after the profiled window" if self.after else "profiled steps (run more steps for unprofiled ones)",
            "step_s_profiled": self.seconds,
            "exposed_comm_s": waited,
            "issue_comm_s": per_step(ISSUE),
            "compute_s": max(0.0, step_s - waited),
            "trace": TRACE,
        }
        if self.memory is not None:
            summary["memory"] = self.memory
        if pipeline is not None:
            summary.update(pipeline_summary(pipeline))
        (folder / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")


def gather_peaks(peak: int | None, device: torch.device) -> list[int | None]:
    """Each rank's `peak`, in rank order, on every rank (-1 travels for None). An all_gather of
    int64 tensors over the default group: nothing is pickled, unlike all_gather_object."""
    if not dist.is_initialized():
        return [peak]
    # NCCL moves only device tensors; gloo (CPU ranks) host ones.
    mine = torch.tensor([-1 if peak is None else peak], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine)
    return [None if p < 0 else p for p in every.tolist()]


def step_waits(events, steps: int) -> list[dict]:
    """Per profiled step (the first `steps` `ProfilerStep#k` ranges, in time order): its seconds
    and the seconds its `wait_tensor` calls spent on receives, sends and collectives (see the
    module docstring for how a wait is attributed). A step the events lack is all NaN."""

    def start(e):
        return e.time_range.start

    ranges = sorted((e for e in events if e.name.startswith(STEP)), key=start)[:steps]
    waits = sorted((e for e in events if e.name == WAIT), key=start)
    ends = sorted((e.time_range.end, kind) for e in events for prefix, kind in P2P_RANGES if e.name.startswith(prefix))
    out = [{"step_s": (r.time_range.end - r.time_range.start) / 1e6, **{k: 0.0 for k in WAIT_KINDS}} for r in ranges]
    j = 0
    for w in waits:
        lo, hi = w.time_range.start, w.time_range.end
        while j < len(ends) and ends[j][0] < lo:  # ranges that ended before this wait (none should)
            j += 1
        kind = "collective"
        if j < len(ends) and ends[j][0] <= hi:
            kind = ends[j][1]
            while j < len(ends) and ends[j][0] <= hi:
                j += 1
        for r, row in zip(ranges, out):
            if r.time_range.start <= lo < r.time_range.end:
                row[kind] += (hi - lo) / 1e6
                break
    nan = float("nan")
    out += [{"step_s": nan, **{k: nan for k in WAIT_KINDS}} for _ in range(steps - len(out))]
    return out


_FIELDS = ("step_s", *WAIT_KINDS)


def gather_waits(rows: list[dict], device: torch.device) -> list[list[dict]]:
    """Every rank's `step_waits` rows, in rank order (an all_gather of float64 tensors over the
    default group, like `gather_peaks`; every rank must call it with as many rows)."""
    mine = torch.tensor([[row[f] for f in _FIELDS] for row in rows], dtype=torch.float64, device=device).reshape(-1)
    every = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine)
    return [[dict(zip(_FIELDS, step)) for step in rank.reshape(-1, len(_FIELDS)).tolist()] for rank in every.reshape(dist.get_world_size(), -1)]


def _median(values) -> float | None:
    values = [v for v in values if v == v]  # NaN: a step a rank's events lacked
    return statistics.median(values) if values else None


def _listed(values) -> list[float | None]:
    return [v if v == v else None for v in values]  # JSON has no NaN


def pipeline_summary(ranks: list[list[dict]]) -> dict:
    """profile.json's pipeline-wait keys from every rank's per-step waits (`gather_waits`)."""
    per_rank: list[dict[str, Any]] = []  # profile.json rows
    for rank, rows in enumerate(ranks):
        p2p = [r["recv"] + r["send"] for r in rows]
        per_rank.append(
            {
                "rank": rank,
                "step_s": _median(r["step_s"] for r in rows),
                "p2p_wait_s": _median(p2p),
                "recv_wait_s": _median(r["recv"] for r in rows),
                "send_wait_s": _median(r["send"] for r in rows),
                "collective_wait_s": _median(r["collective"] for r in rows),
                "p2p_share": _median(w / r["step_s"] for w, r in zip(p2p, rows) if r["step_s"] > 0),
                "wait_share": _median((w + r["collective"]) / r["step_s"] for w, r in zip(p2p, rows) if r["step_s"] > 0),
                "per_step": {
                    "step_s": _listed(r["step_s"] for r in rows),
                    "p2p_wait_s": _listed(p2p),
                    "recv_wait_s": _listed(r["recv"] for r in rows),
                    "send_wait_s": _listed(r["send"] for r in rows),
                    "collective_wait_s": _listed(r["collective"] for r in rows),
                },
            }
        )
    first = per_rank[0]
    return {
        "p2p_wait_s": first["p2p_wait_s"],
        "p2p_recv_wait_s": first["recv_wait_s"],
        "p2p_send_wait_s": first["send_wait_s"],
        "p2p_wait_s_per_step": first["per_step"]["p2p_wait_s"],
        "pipeline_wait": {
            "method": "wait_tensor calls, by the gloo:recv / gloo:send range that ends inside each (else a collective); "
            "per profiled step (ProfilerStep#k), medians over steps",
            "per_rank": per_rank,
        },
    }


def read_summary(folder: Path) -> dict:
    from runner.errors import AotError

    path = Path(folder) / SUMMARY
    if not path.is_file():
        raise AotError(f"{folder}: no {SUMMARY}; write one with `aot run ARTIFACT --profile {folder}`")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise AotError(f"{path}: not valid JSON ({e})") from None

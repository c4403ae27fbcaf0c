"""`aot run --profile DIR`: the measured timeline of a few steps, beside the plan's predicted one.

torch.profiler records up to 5 steps after one warm-up step (so start-up costs stay out); the step
time reported is the median of the steps after that window, which run without profiler overhead. Rank 0 writes DIR/measured_timeline.json (a Chrome trace, like the artifact's predicted
plan/timeline.json) and DIR/profile.json: per step, the measured wall time, the time the program
sat waiting for collectives (`_c10d_functional::wait_tensor`, the communication compute did not
hide) and the rest (compute). `aot inspect ARTIFACT --profile DIR` puts them next to the plan's
prediction.

The first step of the run (the warm-up step, whose time no summary uses) also measures each rank's
peak memory (runner/memory_tracking.py); the peaks are gathered to rank 0 and written under
"memory" in DIR/profile.json.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from runner.memory_tracking import ALLOCATOR
from runner.memory_tracking import method as memory_method

SUMMARY = "profile.json"
TRACE = "measured_timeline.json"
WARMUP_STEPS = 1
WAIT = "_c10d_functional::wait_tensor"
ISSUE = ("_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
         "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single")


class StepProfiler:
    """Wrap the step loop: `with StepProfiler(dir, steps, rank, device) as p: ... p.step(seconds)`."""

    def __init__(self, folder: Path | None, steps: int, rank: int, device: torch.device, tier: str):
        self.folder, self.rank, self.tier = folder, rank, tier
        self.active = max(0, min(steps - WARMUP_STEPS, 5))
        self.seconds: list[float] = []   # the profiled steps
        self.after: list[float] = []     # steps after the profiled window: no profiler overhead
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
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=WARMUP_STEPS, active=self.active, repeat=1))
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
        self._prof.__exit__(*exc)
        if exc[0] is not None or self.rank != 0 or not self.seconds:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.folder / TRACE))
        events = self._prof.events()
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
        (self.folder / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")


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


def read_summary(folder: Path) -> dict:
    from runner.errors import AotError

    path = Path(folder) / SUMMARY
    if not path.is_file():
        raise AotError(f"{folder}: no {SUMMARY}; write one with `aot run ARTIFACT --profile {folder}`")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise AotError(f"{path}: not valid JSON ({e})") from None

"""Planning's independent pieces of work run at once, in worker processes forked from the planner.

Most of a large model's planning is single-threaded Python over independent pieces: tracing and
analyzing one step graph per layout class (the tensor-parallel degree, with or without fsdp:
aot.plan.layout_traces), then pricing every mesh (aot.plan.search: the meshes read from one graph
together, and each pipeline mesh, whose programs are traced). A planner in one process leaves
every core but one idle, so `in_workers` forks one worker per core (the planner's state, the
model's fake tensors, the recorded step and the graphs traced so far, is shared copy-on-write:
nothing is traced or loaded again) and sends each piece of work to the next free worker; what a
worker makes comes back pickled over a pipe (analyses and plans: lists and numbers, never
written anywhere; the plans of a 16,384-rank search of Llama-3-8B are 51 MB, 0.5 s to send).

Forking is used only where it is safe and cheap: on Linux, for more than one piece of work and
more than one core. Each worker runs torch single-threaded before anything else: a child of a
process whose OpenMP pool has run hangs in its first parallel region (GNU OpenMP is not fork-safe;
seen here with torch 2.13), and the workers share the cores between them anyway. Elsewhere
(macOS, Windows: fork is unsafe or missing; `--workers 1`) the work runs in this process, in
order, with the same results (tests/test_plan_workers.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from aot.errors import AotError

_WORK: Callable[[Any], Any] | None = None  # what the forked workers run: set before they fork, read in them


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """Workers a plan runs without `aot plan --workers`: AOT_PLAN_WORKERS where set (how
    `aot build --strategy auto` is told), else one per core this process may use but no more than
    the memory available holds at WORKER_BYTES each (a worker's own graphs and the pages of the
    planner it copies as it touches them: about 1 GB planning Llama-3-70B), at least 1."""
    told = os.environ.get("AOT_PLAN_WORKERS", "").strip()
    if told:
        if not told.isdigit() or int(told) < 1:
            raise AotError(f"AOT_PLAN_WORKERS={told!r}: expected a whole number of processes, at least 1")
        return int(told)
    available = _available_bytes()
    fit = available // WORKER_BYTES if available is not None else usable_cores()
    return max(1, min(usable_cores(), fit))


WORKER_BYTES = 3 << 29  # 1.5 GiB


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def forks_safely() -> bool:
    """Whether workers may be forked here (Linux: fork is neither missing nor unsafe)."""
    return sys.platform.startswith("linux")


def will_fork(jobs: list, workers: int) -> bool:
    """Whether in_workers forks for `jobs` (else it runs them in this process)."""
    return workers > 1 and len(jobs) > 1 and forks_safely()


def in_workers(jobs: list, work: Callable[[Any], Any], workers: int, started: Callable[[Any], None] | None = None) -> list:
    """[work(job) for job in jobs], in that order, run by up to `workers` forked processes at once,
    each job given to the next free one (list the longest first); `started(job)` is called here
    as each job starts. In this process, in order, where one worker would do (`workers` 1, a
    single job) or fork is unsafe here. `work` returns something picklable; what it raises is
    raised here."""
    started = started or (lambda job: None)
    if not will_fork(jobs, workers):
        made = []
        for job in jobs:
            started(job)
            made.append(work(job))
        return made
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    global _WORK
    _WORK = work
    try:
        context = multiprocessing.get_context("fork")
        with warnings.catch_warnings(), ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, initializer=_single_threaded) as pool:
            # Python 3.12+ warns at a fork from a process with threads: torch's OpenMP pool's, which
            # the workers never use (_single_threaded); aot itself starts none
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
            return _run_all(pool, jobs, workers, started)
    except BrokenProcessPool:
        fewer = max(1, workers // 2)
        raise AotError(
            f"a planning worker process ended abruptly (out of memory?): plan with fewer, `aot plan --workers {fewer}` "
            f"(AOT_PLAN_WORKERS={fewer} for `aot build --strategy auto`)"
        ) from None
    finally:
        _WORK = None


def _run_all(pool, jobs: list, workers: int, started: Callable[[Any], None]) -> list:
    """in_workers' loop: each job submitted when a worker is free, the results in job order."""
    from concurrent.futures import FIRST_COMPLETED, wait

    results: dict[int, Any] = {}
    waiting = list(enumerate(jobs))
    running: dict = {}
    while waiting or running:
        while waiting and len(running) < workers:  # a job starts when a worker is free
            i, job = waiting.pop(0)
            started(job)
            running[pool.submit(_run, job)] = i
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in done:
            results[running.pop(future)] = future.result()
    return [results[i] for i in range(len(jobs))]


def _single_threaded() -> None:
    import torch

    torch.set_num_threads(1)


def _run(job: Any) -> Any:
    assert _WORK is not None  # set in the parent before the fork
    return _WORK(job)

"""A search's graphs traced on two cores: a forked copy of the planning process traces part of them.

Tracing is most of `aot plan`'s time and runs on one core (Python). A fork of the planning process
starts with torch, the model and its state already in memory, so a second core costs nothing to set
up. The copy finds the tensor-parallel plan (if the search needs one) and traces its share of the
graphs; each graph comes back as a JSON file in a private folder (with its variants recomputing
activations, where it does not fit: ModelSteps.recomputed), announced by one line on a pipe
(nothing this project writes or reads is a pickle). A graph the copy fails to make, or does not
announce within HELPER_SILENCE_S, is traced by the planning process itself, so the helper can make
a search faster but never different (tests/test_plan_derived_graphs.py).

AOT_PLAN_WORKERS=1 keeps everything in one process.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import sys
import tempfile
import warnings
from dataclasses import asdict

from aot.errors import AotError
from aot.plan.cost_model import CommSite, Memory, Op, StepGraph

HELPER_SILENCE_S = 300.0  # no line from the copy for this long: it is stopped, its graphs traced here

# Relative cost of making a graph, for sharing the work (measured on the GPT example: a tp or
# fsdp graph has more nodes; a derived graph traces only the optimizer; finding the tp plan exports
# the forward).
_COST = {"trace": 1.0, "tp": 1.3, "fsdp": 1.4, "derived": 0.35, "plan": 0.6}


def workers() -> int:
    """Processes to trace with: AOT_PLAN_WORKERS, else the cores this process may use (1 where
    fork is not Linux's)."""
    setting = os.environ.get("AOT_PLAN_WORKERS", "").strip()
    if setting:
        try:
            return max(1, int(setting))
        except ValueError:
            raise AotError(f"AOT_PLAN_WORKERS={setting!r}: expected a whole number of processes") from None
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def split(jobs: list[tuple], derived: dict, find_plan: bool) -> tuple[list[tuple], list[tuple]]:
    """(jobs for this process, jobs for the copy): longest first to whichever side is done sooner,
    the copy starting with the tp plan. jobs: [(key (dp>1, fsdp, tp), mesh)]; derived: key ->
    the graphs derived from it (made by whoever traces the key)."""

    def cost(key) -> float:
        c = _COST["trace"] * (_COST["tp"] if key[2] > 1 else 1.0) * (_COST["fsdp"] if key[1] > 1 else 1.0)
        return c + _COST["derived"] * len(derived.get(key, ()))

    here, there = [], []
    load = {"here": 0.0, "there": _COST["plan"] if find_plan else 0.0}
    for job in sorted(jobs, key=lambda j: -cost(j[0])):
        side = "here" if load["here"] <= load["there"] else "there"
        (here if side == "here" else there).append(job)
        load[side] += cost(job[0])
    # while the copy finds the tp plan, this process traces the graphs without tp first
    here.sort(key=lambda j: j[0][2] > 1)
    return here, there


def graph_to_json(graph: StepGraph) -> dict:
    return asdict(graph)


def graph_from_json(data: dict) -> StepGraph:
    def op(d: dict) -> Op:
        return Op(**{**d, "tensors": tuple(tuple(t) for t in d["tensors"])})

    def comm(d: dict) -> CommSite:
        return CommSite(**{**d, "pre_ops": [op(o) for o in d["pre_ops"]], "post_ops": [op(o) for o in d["post_ops"]], "readers": tuple(d["readers"])})

    memory = data["memory"]
    return StepGraph(
        ops=[op(o) for o in data["ops"]],
        comms=[comm(c) for c in data["comms"]],
        memory=Memory(
            **{**memory, "resident_tensors": tuple(tuple(t) for t in memory["resident_tensors"]), "intervals": tuple(tuple(t) for t in memory["intervals"])}
        ),
        graph_nodes=data["graph_nodes"],
    )


class Helper:
    """The forked copy and this process's end of it. `steps` is the ModelSteps whose graphs it makes;
    `jobs` [(key, mesh)] are traced there with `steps._trace` (which also makes the graphs derived
    from each); `find_plan`: find the tensor-parallel plan first."""

    def __init__(self, steps, jobs: list[tuple], find_plan: bool):
        self.steps = steps
        self.folder = tempfile.mkdtemp(prefix="aot-plan-")
        self.jobs = {key for key, _ in jobs} | {other for key, _ in jobs for other, _ in steps._derived.get(key, ())}
        self.find_plan = find_plan
        self.lines: dict[str, dict] = {}  # what the copy announced, by what it is ("plan" or a key)
        self._pending = b""
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else the copy writes this process's buffered output again
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # forking with threads: the copy only traces
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                self._serve(steps, jobs, write)
                code = 0
            finally:
                os._exit(code)  # never return into the caller's stack, run no atexit handler
        os.close(write)
        self.pid, self.read = pid, read

    # -- the copy ---------------------------------------------------------------------------------
    def _serve(self, steps, jobs: list[tuple], fd: int) -> None:
        import gc

        import torch

        torch.set_num_threads(1)  # as DataLoader workers do: the parent's thread pool is not the copy's
        gc.freeze()  # what the copy inherited: no collection walks (and so copies) those pages

        def announce(what: str, **fields) -> None:
            line = (json.dumps({"what": what, **fields}) + "\n").encode()
            os.write(fd, line)  # one short line: written whole

        if self.find_plan:
            try:
                steps._tp_plan = steps._find_plan()
            except Exception:  # noqa: BLE001  (this process finds it again and reports the error)
                steps._tp_plan = None
            announce("plan", plan=steps._tp_plan)
        for key, source in jobs:
            try:
                graphs = steps._trace(key, source)
            except Exception:  # noqa: BLE001  (traced again here, where the error is reported)
                graphs = {}
            for k in [key, *(other for other, _ in steps._derived.get(key, ()))]:
                path = None
                if graphs.get(k) is not None:
                    path = os.path.join(self.folder, f"{'-'.join(str(int(v)) for v in k)}.json")
                    made = {
                        "graph": graph_to_json(graphs[k]),
                        "recompute": [[f, graph_to_json(g)] for f, g in steps.recomputed.get(k, ())],
                        "recompute_failed": steps.recompute_failed.get(k),
                    }
                    with open(path + ".part", "w") as f:
                        json.dump(made, f)
                    os.replace(path + ".part", path)
                announce(json.dumps(list(k)), path=path)
        os.close(fd)

    # -- this process -----------------------------------------------------------------------------
    def _wait_for(self, what: str) -> dict | None:
        while what not in self.lines:
            if self.pid is None:
                return None
            ready, _, _ = select.select([self.read], [], [], HELPER_SILENCE_S)
            chunk = os.read(self.read, 1 << 16) if ready else b""
            if not chunk:  # the copy ended, failed or went silent: what it did not announce is made here
                self.close()
                return None
            self._pending += chunk
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                message = json.loads(line)
                self.lines[message.pop("what")] = message
        return self.lines.pop(what)

    def plan(self) -> dict | None:
        """The tensor-parallel plan the copy found (None: not asked, or it failed)."""
        if not self.find_plan:
            return None
        self.find_plan = False
        message = self._wait_for("plan")
        return None if message is None else message["plan"]

    def take(self, key: tuple) -> StepGraph | None:
        """The copy's graph for `key`; None where it was not the copy's or the copy did not make it.
        Its recomputing variants (or why there are none) go into the ModelSteps' `recomputed`
        (`recompute_failed`)."""
        if key not in self.jobs:
            return None
        self.jobs.discard(key)
        message = self._wait_for(json.dumps(list(key)))
        graph = None
        if message is not None and message["path"] is not None:
            with open(message["path"]) as f:
                made = json.load(f)
            graph = graph_from_json(made["graph"])
            if made["recompute"]:
                self.steps.recomputed[key] = [(f, graph_from_json(g)) for f, g in made["recompute"]]
            if made["recompute_failed"] is not None:
                self.steps.recompute_failed[key] = made["recompute_failed"]
        if not self.jobs and not self.find_plan:
            self.close()
        return graph

    def close(self) -> None:
        """Stop and reap the copy (if still running) and remove its folder."""
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
            os.close(self.read)
        shutil.rmtree(self.folder, ignore_errors=True)

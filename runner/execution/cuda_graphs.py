"""Whole-step CUDA graphs (`aot run --cuda-graphs auto|on|off`, issue #46 item 2).

A training step is one static program: after a few eager steps the runner captures it once
(forward, backward, collectives and the optimizer update) as a CUDA graph and replays it every
step, so a step costs one launch instead of thousands. What changes between steps is copied into
the graph's own buffers before each replay: the batch (`copy_`), the learning rates (`fill_` of
device scalars; a CPU scalar would be read once, at capture, and frozen in the graph). The
parameters and optimizer state are the program's inputs already and are updated in place. The
program's random ops draw from the device generator, which the graph reads at each replay: the
runner seeds it per step as before (runner/execution/trainer.py `seed_step`), so a captured run
draws the masks an uncaptured one does, and resumes alike.

What a graph cannot hold is found before or at capture and named in one line, and the run goes on
uncaptured: a CPU device, collectives through gloo (they run on the host), a pipeline's sends and
receives, anything the capture refuses (a host sync or a CPU op inside the program).
"""

from __future__ import annotations

from typing import Callable

import torch

from runner.errors import AotError

MODES = ("auto", "on", "off")
# Eager steps before the capture: the first launches initialize what a graph must not (cuBLAS
# handles and workspaces, the allocator's pools, NCCL communicators, lazily loaded kernels).
WARMUP_STEPS = 3


def graphs_refused(device: torch.device, pipeline: bool, host_collectives: bool) -> str | None:
    """Why a step on `device` cannot be one CUDA graph, or None where it can."""
    if device.type != "cuda":
        return f"this rank runs on {device.type}, and CUDA graphs need a CUDA device"
    if pipeline:
        return "a pipeline stage's program sends and receives between ranks, which a CUDA graph does not capture"
    if host_collectives:
        return "this rank's collectives go through gloo, on the host, which a CUDA graph does not capture"
    return None


def resolve_graphs(mode: str, refused: str | None) -> bool:
    """Whether to capture: `on` where the step can be captured (else one line, an error), `auto`
    where it can, `off` never."""
    if mode not in MODES:
        raise AotError(f"--cuda-graphs {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "on" and refused is not None:
        raise AotError(f"--cuda-graphs on: {refused}; run with --cuda-graphs off (or auto)")
    return mode != "off" and refused is None


class GraphedStep:
    """`module(*args)` run eagerly for WARMUP_STEPS calls, then captured once as a CUDA graph and
    replayed. `batch` are the positions of `args` that change from step to step (copied into the
    graph's buffers); every other argument must be the same tensor at every call (state updated
    in place, device scalars filled in place). A capture that fails is said once in `log`, and
    every later step runs eagerly. Outputs are copied out of the graph's buffers, so a step's
    results stay readable after the next replay (the runner reads them a step late)."""

    def __init__(self, module: Callable, batch: list[int], log: Callable[[str], None]):
        self.module, self.batch, self.log = module, batch, log
        self.warmup = WARMUP_STEPS  # eager calls left before the capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None
        self._buffers: list = []
        self._outputs: tuple = ()
        self._pinned: list = []  # the arguments captured that are not copied: they must not change

    def __call__(self, *args):
        if self.failed is not None or self.warmup > 0:
            self.warmup -= 1
            return self.module(*args)
        if self.graph is None and not self._capture(args):
            return self.module(*args)
        for position, buffer in zip(self.batch, self._buffers):
            buffer.copy_(args[position], non_blocking=True)
        if any(args[i] is not kept for i, kept in self._pinned):
            raise AotError("a captured step was given another tensor for its state or learning rates: they must be updated in place")
        assert self.graph is not None  # captured above
        self.graph.replay()
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in self._outputs)

    def _capture(self, args) -> bool:
        """Capture the step on `args` (nothing runs: the caller replays it); False, said once, where
        it cannot be captured."""
        buffers = [torch.empty_like(args[i]) for i in self.batch]
        static = list(args)
        for position, buffer in zip(self.batch, buffers):
            static[position] = buffer
        graph = torch.cuda.CUDAGraph()
        # the capture records the random ops' draws and moves the generator past them; the replay
        # that runs this step must start where the step's seed left it, as an uncaptured step does
        seeded = torch.cuda.get_rng_state()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                outputs = self.module(*static)
        except Exception as e:  # noqa: BLE001  (whatever the capture refuses, the step runs eagerly)
            torch.cuda.synchronize()
            torch.cuda.set_rng_state(seeded)
            self.failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.log(f"cuda graphs: the step could not be captured ({self.failed}); it runs uncaptured")
            return False
        torch.cuda.set_rng_state(seeded)
        self.graph, self._buffers = graph, buffers
        self._outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        self._pinned = [(i, a) for i, a in enumerate(args) if i not in self.batch and isinstance(a, torch.Tensor)]
        self.log(f"cuda graphs: the step captured after {WARMUP_STEPS} eager step(s); each step is one replay")
        return True

"""A step queued on the device and read back later: how long it ran (`StepTiming`) and its
results (`LaunchedStep`), so `aot run` queues step n+1 before it reads step n's loss."""

from __future__ import annotations

import time
from typing import Protocol

import torch


class _Stuck(Protocol):
    """What a step's results need of the trainer that launched it (runner/execution/trainer.py):
    a collective that failed or timed out, as one line."""

    def stuck_error(self, error: RuntimeError) -> Exception: ...


class StepTiming:
    """How long a step ran: on CUDA, between two events recorded around it (read once it is done,
    so timing waits for nothing); elsewhere the host's time in the call, which ran the step."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._started = time.perf_counter()
        self._host_s = 0.0
        self._events = None
        if self._cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        self._host_s = time.perf_counter() - self._started
        if self._events is not None:
            self._events[1].record()

    def seconds(self) -> float:
        if self._events is None:
            return self._host_s
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


class LaunchedStep:
    """A queued step's results, left on the device until read: `loss()`, `skipped()` (fp16: the
    update was skipped on overflow), `loss_scale()` (fp16: the scale after it) and `seconds()`.
    Reading one waits for the step (a collective that timed out is reported then, as one line)."""

    def __init__(
        self,
        trainer: _Stuck,
        number: int,
        loss: torch.Tensor,
        found_inf: torch.Tensor | None,
        scale: torch.Tensor | None,
        timing: StepTiming,
        dropped: torch.Tensor | None = None,
    ):
        self.number = number  # 1-based: the step this was
        self._trainer, self._loss, self._found_inf, self._scale, self._timing = trainer, loss, found_inf, scale, timing
        self._dropped = dropped

    def _read(self, read):
        try:
            return read()
        except RuntimeError as e:
            raise self._trainer.stuck_error(e) from e

    def loss(self) -> float:
        return self._read(lambda: float(self._loss))

    def skipped(self) -> bool:
        found_inf = self._found_inf
        return found_inf is not None and self._read(lambda: bool(found_inf.item() > 0))

    def moe_dropped(self) -> int | None:
        """Expert parallelism with a capacity factor: the token choices the step's experts dropped,
        over every data rank (None without one)."""
        dropped = self._dropped
        return None if dropped is None else self._read(lambda: int(dropped.item()))

    def loss_scale(self) -> float | None:
        scale = self._scale
        return None if scale is None else self._read(lambda: float(scale.item()))

    def seconds(self) -> float:
        return self._read(self._timing.seconds)

"""Preemption: SIGTERM or SIGUSR1 (Kubernetes' eviction, Slurm's `--signal`) asks a run to stop;
every rank finishes the same step, the checkpoint is written to `--save` as at the end of a run,
and each rank exits with status PREEMPTED. `--resume` (or torchrun's restart) then continues
exactly where an uninterrupted run would be.

Ranks must stop after the same step, or the checkpoint's shards would be of different steps, and
the signal may reach one rank only, or each at a different step. So the ranks agree: after
launching each step every rank contributes whether it has received a signal to an all_reduce
(MAX) on a gloo group of its own, started without waiting and waited for one step later, after
the next step is launched (the answer is there by then: the wait costs the loop nothing). Every
rank waits for the same all_reduce at the same step, so all see one answer and stop after the
same step. A second signal stops the process at once, as it would without aot.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

PREEMPTED = 75  # exit status of a preempted rank (EX_TEMPFAIL: try again, from the checkpoint)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, distributed: bool, timeout_s: float):
        self.received: str | None = None  # the signal this process received, by name
        self._flag = torch.zeros(1, dtype=torch.int32)
        # its own gloo group: the step's collectives never share a gloo context with it
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if distributed else None
        self._work = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if self.received is not None:  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum).name

    def stop_now(self) -> bool:
        """Called once after each step is launched, by every rank: whether every rank stops after
        the step just launched (some rank had received a signal when it launched the one before)."""
        if self._group is None:
            return self.received is not None
        agreed = False
        if self._work is not None:
            self._work.wait()
            self._work = None
            agreed = bool(self._flag.item())
        if not agreed:
            self._flag.fill_(1 if self.received is not None else 0)
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def close(self, wait: bool = True) -> None:
        """The agreement in flight finished (before the groups are torn down; not after a failed
        step, whose peers may be gone), the handlers restored."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)

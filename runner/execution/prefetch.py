"""Batches read ahead: a background thread reads the next steps' batches (runner/execution/data.py)
while the current step runs, so a step waits for its data only when reading is slower than
training. On CUDA each batch is put in pinned memory, so the trainer's non-blocking copy to the
GPU overlaps the step before it.

The step-indexed contract is unchanged: step s still reads `source.batch(s)`, in step order, and
an error reading it (a shard changed on disk, a token out of range) is raised by the step that
asks for it, as if read there.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

DEPTH = 2  # batches read ahead: one being copied, one ready


class Prefetcher:
    """`batch(step)` for steps first, first + 1, ..., last - 1, each read on a thread up to DEPTH
    steps ahead; `close()` stops the thread (a run stopped early)."""

    def __init__(self, source, first: int, last: int, device: torch.device, depth: int = DEPTH):
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._pin = device.type == "cuda"
        self._next = first
        self._thread = threading.Thread(target=self._read, args=(source, first, last), name="aot-data", daemon=True)
        self._thread.start()

    def _read(self, source, first: int, last: int) -> None:
        for step in range(first, last):
            try:
                inputs, targets = source.batch(step)
                if self._pin:
                    inputs, targets = [t.pin_memory() for t in inputs], targets.pin_memory()
                item: tuple = (step, (inputs, targets), None)
            except BaseException as e:  # raised by the step that reads it
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def batch(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor, float]:
        """(inputs, targets, seconds waited for them) of `step`, the next step in order."""
        assert step == self._next, (step, self._next)  # the loop asks in step order
        began = time.perf_counter()
        read, batch, error = self._ready.get()
        waited = time.perf_counter() - began
        assert read == step
        if error is not None:
            raise error
        self._next += 1
        return batch[0], batch[1], waited

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

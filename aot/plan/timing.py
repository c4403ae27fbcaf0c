"""Timing small pieces of work on a device: wall seconds with the device synchronized around each
call (CUDA runs asynchronously), and the per-call median of short runs of calls."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def per_call(fn, device, reps: int, inner: int) -> float:
    """Median seconds of one call of `fn`, timed over `inner` calls in a row (one warm-up first):
    a single call of a small kernel is shorter than the timer's own noise."""

    def run():
        for _ in range(inner):
            fn()

    run()
    return statistics.median(timed(run, device, reps)) / inner

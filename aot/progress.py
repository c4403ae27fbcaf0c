"""Progress display for long commands: one line per stage with its duration, on stderr."""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    def __init__(self, total: int, quiet: bool = False, stream=None):
        self.total, self.quiet = total, quiet
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, title: str):
        self.done += 1
        self._write(f"[{self.done}/{self.total}] {title} ...", end="")
        start = time.perf_counter()
        try:
            yield self
        except BaseException:
            self._write(" failed")
            raise
        self._write(f" {time.perf_counter() - start:.1f} s")

    def note(self, message: str) -> None:
        self._write(f"      {message}")

    def warn(self, message: str) -> None:
        """A warning line; printed even when quiet (quiet silences progress, not problems)."""
        self.stream.write(f"warning: {message}\n")
        self.stream.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _write(self, text: str, end: str = "\n") -> None:
        if not self.quiet:
            self.stream.write(text + end)
            self.stream.flush()

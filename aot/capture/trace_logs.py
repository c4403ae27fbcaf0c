"""Keeping torch's tracing logs out of the user's terminal."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_trace_logs():
    """FakeTensor logs a full traceback when an op's shape check fails, and the shape environment
    logs the graph so far when control flow depends on a tensor's value; the user gets one line
    from us instead (and the traceback with --debug, which re-raises)."""
    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, previous):
            logger.setLevel(level)

"""The runner's messages for programs that load artifacts themselves (`runner.load()`).

`aot run` prints its messages itself. A program calling `runner.load()` gets them from the `aot`
logger instead: warnings (a topology mismatch allowed through, NVML missing) and notices (a
compiled package passed over, weights cast on load) at WARNING, what the run set up (NCCL_ALGO,
the CPU cores a rank is bound to) at INFO. Each record carries the rank (`record.rank`), and in a
job of several ranks its message starts `[rank R] `, so ranks writing to one log stay apart.
With no logging configured, Python's last-resort handler still shows the warnings on stderr;
`logging.basicConfig(level=logging.INFO)` shows the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

LOGGER = logging.getLogger("aot")


class RankLogger(logging.LoggerAdapter):
    """The `aot` logger for one rank of a job of `world_size`."""

    extra: Mapping[str, object]  # never None: __init__ always passes the rank

    def __init__(self, rank: int, world_size: int):
        super().__init__(LOGGER, {"rank": rank})
        self.prefix = f"[rank {rank}] " if world_size > 1 else ""

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}
        return f"{self.prefix}{msg}", kwargs

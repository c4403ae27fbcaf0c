"""An error every rank of a node raises alike before its process group starts, and how they exit.

Under torchrun the first worker to exit gets its siblings killed (SIGTERM) at once. When every
rank refuses to start for the same reason (a topology mismatch, a compiled package this CPU cannot
run) the first to exit would cut the others' lines off, so the user would see one rank's
error, or none of the mismatch list. Each rank therefore prints its line, marks it printed in
torchrun's agent store (it outlives the workers) and exits only once every local rank of its node
has done the same, or after `WAIT_S`. Outside torchrun there is nothing to wait for.
"""

from __future__ import annotations

import os
from datetime import timedelta

from runner.errors import AotError

# How long a rank that has printed its refusal waits for its node's other ranks to print theirs.
WAIT_S = 60.0


class NodeRefusal(AotError):
    """Raised alike by every rank of a node before the process group starts."""

    def __init__(self, message: str, env=None):
        super().__init__(message)
        self.env = os.environ if env is None else env

    def before_exit(self) -> None:
        store = _agent_store(self.env)
        if store is None:
            return
        mine, everyone = _printed_keys(self.env)
        try:
            store.set(mine, "1")
            store.wait(everyone, timedelta(seconds=WAIT_S))
        except Exception:  # noqa: BLE001 - the store gone or a rank that never refused: exit anyway
            pass


def _agent_store(env):
    """A client of torchrun's agent store; None outside torchrun (or when it cannot be reached)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store to coordinate through: exit at once
        return None


def _printed_keys(env) -> tuple[str, list[str]]:
    """(this rank's key, every local rank's key): per node and per torchrun attempt, so a restarted
    group never sees the last attempt's marks nor another node's."""
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    node = f"aot/attempt-{attempt}/refused/node-{env.get('GROUP_RANK', '0') or '0'}"
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or "1")
    return f"{node}/local-{env.get('LOCAL_RANK', '0') or '0'}", [f"{node}/local-{r}" for r in range(local_world)]

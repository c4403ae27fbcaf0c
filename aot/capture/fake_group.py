"""A fake process group: collectives for N ranks traced (or compiled) in one process, none run.

Tensor-parallel capture (DTensor needs a process group to propagate placements over) and the
AOTInductor compile (it resolves the programs' group names) both need one. The "fake" backend is
torch's own (`FakeProcessGroup`, in the C++ core), but torch 2.13 registers it only when
`torch.testing._internal.distributed.fake_pg` is imported: that import, here alone, is the one use
of a private torch module for it (tests/test_layers.py keeps it here). The store is the public
in-memory `HashStore`; the fake backend reads nothing from it.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from aot.errors import AotError


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, what: str):
    """The default process group, fake, as rank `rank` of `world_size`, while the context lasts;
    `what` needs it (said if a process group is already initialized)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend; module docstring)

    if dist.is_initialized():
        raise AotError(f"{what} needs its own (fake) process group, but one is already initialized")
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()

"""Explicit process-group binding.

A traced graph names its process groups by strings. aot builds graphs with canonical names
("aot.dp", one per mesh axis) instead of torch's process-local counters, and the manifest lists
every group of each axis by its rank list. At start-up each rank creates the groups of every axis
in manifest order (group creation is collective over the world) and registers the one it belongs
to under the graph's name, so the order in which a cluster creates groups does not matter.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

from runner.errors import AotError


def bind_process_groups(process_groups: dict, rank: int, world_size: int) -> dict[str, tuple[list[int], object]]:
    """Create and register the groups the manifest names; returns name -> (this rank's members,
    the live process group)."""
    bound: dict[str, tuple[list[int], object]] = {}
    for name, spec in process_groups.items():
        mine = None
        for ranks in spec["groups"]:
            if sorted(ranks) == list(range(world_size)):
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks)
            if rank in ranks:
                mine, bound[name] = group, (list(ranks), group)
        if mine is None:
            raise AotError(f"manifest: rank {rank} belongs to no group of {name!r}")
        try:
            _unregister_process_group(name)
        except Exception:  # nothing registered under that name yet
            pass
        _register_process_group(name, mine)
    return bound


def leave_process_group() -> None:
    """Tear the process group down together: a gloo rank that destroys its group while a peer is
    still inside a collective or writing files can abort the peer ("terminate called without an
    active exception"), so every rank waits for the others first."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()

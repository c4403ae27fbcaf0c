"""Explicit process-group binding.

A traced graph names its process groups by strings. aot builds graphs with canonical names
("aot.dp", one per mesh axis) instead of torch's process-local counters, and the manifest lists
every group of each axis by its rank list. At start-up each rank creates the groups of every axis
in manifest order (group creation is collective over the world) and registers the one it belongs
to under the graph's name, so the order in which a cluster creates groups does not matter.
"""

from __future__ import annotations

import os

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


GLOO_POLL_THREAD = "gloo_tcp_loop"
GLOO_POLL_NICE = 19


def yield_gloo_poll_threads() -> int:
    """Lower gloo's transport poll thread in this process to nice 19; returns how many were found.

    On CPU ranks sharing cores, that thread keeps a core busy between socket events (perf sched:
    the two ranks' poll threads ran 996 ms of every 2,000 while 4 KiB all_reduces ran back to
    back), and the threads that carry each collective (gloo's worker, the rank's main thread)
    wait for a core, a fifth of the time a whole scheduler tick: a 0.5 ms all_reduce averaged
    1.7 ms. At nice 19 the poll thread yields to them: 0.6-0.8 ms, and at 4 ranks on 2 cores
    an FSDP step of examples/gpt.py 36-42% faster (BENCHMARKS.md, "gloo's poll threads"). Threads are found by name under
    /proc/self/task (Linux); elsewhere, or if the kernel refuses, nothing changes. Call it once
    every group this process will use exists (each gloo group starts its own poll thread).
    AOT_GLOO_YIELD=0 leaves them as they are (to measure the difference)."""
    if os.environ.get("AOT_GLOO_YIELD", "1") == "0":
        return 0
    found = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_POLL_THREAD:
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), GLOO_POLL_NICE)
            found += 1
        except OSError:  # the thread ended, or no permission: leave it as it is
            continue
    return found


def leave_process_group() -> None:
    """Tear the process group down together: a gloo rank that destroys its group while a peer is
    still inside a collective or writing files can abort the peer ("terminate called without an
    active exception"), so every rank waits for the others first; a peer that never gets there
    (stuck, or gone) ends the wait at the group's timeout in one line."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError as e:
        raise AotError(f"finished, but another rank did not reach the end of the run; it is stuck or gone ({str(e).strip().splitlines()[0]})") from e
    finally:
        dist.destroy_process_group()

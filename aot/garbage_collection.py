"""How often Python's cyclic garbage collector walks the objects while aot builds or plans.

A build or a plan of a large step holds millions of long-lived objects (fake tensors, FX nodes and
their metadata) that it allocates all along. CPython collects its oldest generation whenever the
objects that reached it have grown by a quarter, walking every one of them each time: in a
DeepSeek-V3-sized build (61 layers, 1,024 ranks) that was 12.5 s of 62 (gc.callbacks), for
garbage that the young generations mostly free on their own. Inside `collected_less_often` the
oldest generation is never collected automatically (the thresholds are restored after, and the
next collection takes what accumulated): the same build took 45-48 s, its artifact byte for byte
the same, its peak resident memory 6% higher (1.30 GB instead of 1.23 GB); planning Llama-3-8B
for 1,024 ranks about a second less, with 14% more memory (0.87 GB).

The young generations' best thresholds differ: tracing the planner's many small graphs made a
thousand young collections at the default thresholds (a tenth of its search's time), so it raises
them, and collects the middle generation no more than the oldest: what survives a young
collection there is mostly the records and graphs it keeps, walked once more for nothing (planning
Llama-3-70B for 1,024 ranks: 27.5 s -> 25.7 s with 2 workers, 44.3 -> 42.4 s in one process, whose
peak went from 1.39 to 1.48 GB). A build's one large trace is fastest with the defaults (raised,
its young collections took 2.8 s instead of 1.2). And when the process ends, Python's last collections walk every object
torch and the traces made, several times over (about a second): frozen at exit (atexit handlers
run first), they are skipped, and the memory goes with the process.
"""

from __future__ import annotations

import atexit
import contextlib
import gc

# gen1 collections between automatic collections of the oldest generation: never, in practice
DEFERRED = 10**9

# whether the command running is this process's last work (aot/cli.py `main`: `aot plan` and
# `aot build` as commands, not called from a program or a test, which go on after them)
_COMMAND_ENDS_PROCESS = False


def command_ends_process() -> None:
    """Say that the command about to run is this process's last work (the command line's entry)."""
    global _COMMAND_ENDS_PROCESS
    _COMMAND_ENDS_PROCESS = True


_DEPTH = 0  # collected_less_often blocks open


@contextlib.contextmanager
def collected_less_often(young: int = 0, middle: int = 0):
    """Inside: no automatic collection of the oldest generation, and the young generations'
    thresholds raised to at least `young` and `middle`; at exit, the objects frozen. Where the
    command is the process's last work (`command_ends_process`), frozen as the block ends: the
    thresholds restored there would start a full collection at once, walking every object the
    plan or build made (1.7 s of 26 planning Llama-3-8B for 1,024 ranks in one process), memory
    the process gives back as it ends a moment later anyway."""
    global _DEPTH
    atexit.unregister(gc.freeze)  # registered once however often a process builds or plans
    atexit.register(gc.freeze)
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], young), max(thresholds[1], middle), DEFERRED)
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _COMMAND_ENDS_PROCESS and not _DEPTH:  # the command's own block (a plan inside a build goes on to the build)
            gc.freeze()
        gc.set_threshold(*thresholds)

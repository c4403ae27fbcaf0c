"""aot/garbage_collection.py: a command that is its process's last work freezes its objects as its
outermost block ends (no full collection walks them just before the process ends); a plan inside a
build, or a command run from a program or a test, freezes nothing."""

import subprocess
import sys

PROBE = """
import gc, sys
from aot import garbage_collection as g
if sys.argv[1] == "last":
    g.command_ends_process()
kept = [[i] for i in range(1000)]  # objects the command made
with g.collected_less_often(young=50_000, middle=g.DEFERRED):
    with g.collected_less_often():  # a plan inside a build
        pass
    inner = gc.get_freeze_count()
outer = gc.get_freeze_count()
print(inner, outer > 0, gc.get_threshold() == (700, 10, 10))
"""


def _probe(mode: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout.split()


def test_the_commands_own_block_freezes_where_the_process_ends_with_it():
    assert _probe("last") == ["0", "True", "True"]  # the inner block froze nothing, the outer all; thresholds restored
    assert _probe("called") == ["0", "False", "True"]  # from a program: collected as usual after

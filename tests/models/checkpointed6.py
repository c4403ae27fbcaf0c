"""tests/models/checkpointed_dropout.py with 6 blocks, each under torch.utils.checkpoint: a deep
model whose checkpoint calls the planner writes out from 3 blocks (aot/plan/repeated_blocks.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_checkpointed6", Path(__file__).resolve().parent / "checkpointed_dropout.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
batch = base.batch


def model():
    return base.Net(depth=6)

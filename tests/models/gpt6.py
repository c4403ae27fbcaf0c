"""examples/gpt.py with 6 blocks: a model the planner traces cut to 3 blocks and writes out to 6
(aot/plan/repeated_blocks.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_gpt6", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
gpt.n_layer = 6

model, batch, loss, optimizer, scheduler = gpt.model, gpt.batch, gpt.loss, gpt.optimizer, gpt.scheduler
max_grad_norm = gpt.max_grad_norm
n_head = gpt.n_head  # aot checks a --strategy tp=N against it

"""examples/gpt.py with dropout 0.1 (after attention's softmax and on each residual branch): the
model file recomputation tests train, where recomputed ops must read the same random draws."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_gpt", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
gpt.dropout = 0.1

model, batch, loss, optimizer, scheduler = gpt.model, gpt.batch, gpt.loss, gpt.optimizer, gpt.scheduler
max_grad_norm = gpt.max_grad_norm

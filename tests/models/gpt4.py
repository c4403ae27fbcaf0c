"""examples/gpt.py with 4 blocks: enough layers for an interleaved pipeline of 2 ranks x 2 stages."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_gpt4", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
gpt.n_layer = 4

model, batch, loss, optimizer, scheduler = gpt.model, gpt.batch, gpt.loss, gpt.optimizer, gpt.scheduler
max_grad_norm = gpt.max_grad_norm

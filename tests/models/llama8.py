"""examples/llama.py (tiny) with 8 decoder layers: deep enough that the planner writes its steps
out from the model at 4, 5 and 6 layers (aot/plan/written_out.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_llama8", Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.n_layers = 8

model, batch, loss, optimizer, scheduler = llama.model, llama.batch, llama.loss, llama.optimizer, llama.scheduler
max_grad_norm = llama.max_grad_norm
n_heads, n_kv_heads = llama.n_heads, llama.n_kv_heads

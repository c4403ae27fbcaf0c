"""examples/llama.py (tiny) with 6 decoder layers: a model the planner traces cut to 3 layers and
writes out to 6 (aot/plan/repeated_blocks.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_llama6", Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.n_layers = 6

model, batch, loss, optimizer, scheduler = llama.model, llama.batch, llama.loss, llama.optimizer, llama.scheduler
max_grad_norm = llama.max_grad_norm
n_heads, n_kv_heads = llama.n_heads, llama.n_kv_heads

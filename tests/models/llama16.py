"""examples/llama.py (tiny) with 16 decoder layers: deep enough that a pipeline's stages are
moved one layer at a time (tests/test_plan_search.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_llama8", Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.n_layers = 16

model, batch, loss, optimizer, scheduler = llama.model, llama.batch, llama.loss, llama.optimizer, llama.scheduler
max_grad_norm = llama.max_grad_norm
n_heads, n_kv_heads = llama.n_heads, llama.n_kv_heads

"""examples/llama.py (tiny) made wide enough for a GPU profile's matmuls to take more than a
kernel's launch (dim 2048, ffn 8192, 1,024 tokens) at 8 layers: where tensor parallelism's split
matmuls cost more per sample than the plans without it (tests/test_class_floor.py). Planned only:
its graphs are traced on fake tensors."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_example_llama_wide", Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)
llama.n_layers, llama.dim, llama.ffn_dim, llama.seq_len, llama.n_heads, llama.n_kv_heads = 8, 2048, 8192, 1024, 16, 8
llama.head_dim = llama.dim // llama.n_heads

model, batch, loss, optimizer, scheduler = llama.model, llama.batch, llama.loss, llama.optimizer, llama.scheduler
max_grad_norm = llama.max_grad_norm
n_heads, n_kv_heads = llama.n_heads, llama.n_kv_heads

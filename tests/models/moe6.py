"""transformers' Qwen3-MoE at the zoo's tiny size with 6 layers: a model of repeated blocks with
experts, which the planner traces cut to 3 blocks and writes out (tests/test_compile_path.py)."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

shapes = {**hf.LLAMA_SHAPES, "num_hidden_layers": 6}
model, batch, loss = hf.causal_lm(transformers.Qwen3MoeConfig(**shapes, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))

"""transformers' Qwen3ForCausalLM, tiny: RMSNorm on every head's queries and keys inside attention
(q_norm, k_norm), weights that tensor parallelism keeps whole while each rank normalizes only its
own heads, so their gradients are per-rank partial sums that must be summed over tp."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

model, batch, loss = hf.causal_lm(transformers.Qwen3Config(**hf.LLAMA_SHAPES, head_dim=16))

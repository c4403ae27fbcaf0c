"""transformers' LlamaForCausalLM, tiny, with grouped-query attention (4 heads, 2 key/value heads)."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

model, batch, loss = hf.causal_lm(transformers.LlamaConfig(**hf.LLAMA_SHAPES))

"""transformers' Qwen2ForCausalLM, tiny, with grouped-query attention and biases on q, k and v."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

model, batch, loss = hf.causal_lm(transformers.Qwen2Config(**hf.LLAMA_SHAPES))

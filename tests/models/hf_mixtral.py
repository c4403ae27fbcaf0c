"""transformers' MixtralForCausalLM, tiny: attention as Llama's, a mixture of 4 experts (top 2) for the MLP."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

model, batch, loss = hf.causal_lm(transformers.MixtralConfig(**hf.LLAMA_SHAPES, num_local_experts=4, num_experts_per_tok=2))

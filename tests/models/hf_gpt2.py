"""transformers' GPT2LMHeadModel, tiny: Conv1D layers (weights stored (in, out)) and the fused
q/k/v projection `c_attn` whose output the attention splits in three. Dropout off."""

import importlib.util
from pathlib import Path

import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).with_name("hf_causal_lm.py"))
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

# bos/eos inside the tiny vocabulary (transformers warns about GPT-2's 50256 otherwise)
config = transformers.GPT2Config(
    vocab_size=hf.VOCAB,
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
model, batch, loss = hf.causal_lm(config)

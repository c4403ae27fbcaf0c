"""The model zoo's families (issue #39): transformers' configs at tiny sizes, random init, no downloads.

Each `tests/models/zoo/<family>.py` is a model file of three lines that calls `model_file(family)`.
Decoder families are wrapped by tests/models/hf_causal_lm.py (token ids in, logits out, next-token
cross-entropy); T5 runs its encoder and decoder on the same ids. No dropout anywhere: the runs are
compared with eager PyTorch.
"""

import importlib.util
from pathlib import Path

import torch
import transformers

_spec = importlib.util.spec_from_file_location("aot_test_hf_causal_lm", Path(__file__).parents[1] / "hf_causal_lm.py")
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

LLAMA = hf.LLAMA_SHAPES
NO_DROPOUT = dict(attention_dropout=0.0)


def configs() -> dict:
    """family -> its transformers config (built on demand: each is cheap)."""
    return {
        "llama": lambda: transformers.LlamaConfig(**LLAMA),
        "mistral": lambda: transformers.MistralConfig(**LLAMA, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**LLAMA),
        "qwen3": lambda: transformers.Qwen3Config(**LLAMA, head_dim=16),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**LLAMA, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "gemma2": lambda: transformers.Gemma2Config(**{**LLAMA, "attn_implementation": "eager"}, head_dim=16, sliding_window=8),
        "gemma3": lambda: transformers.Gemma3TextConfig(**LLAMA, head_dim=16, sliding_window=8),
        "phi3": lambda: transformers.Phi3Config(**LLAMA, pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0),
        "olmo2": lambda: transformers.Olmo2Config(**LLAMA, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "gpt2": lambda: transformers.GPT2Config(
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
        ),
        "bert": lambda: transformers.BertConfig(
            vocab_size=hf.VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            is_decoder=True,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
        ),
        "t5": lambda: transformers.T5Config(
            vocab_size=hf.VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
        "mamba": lambda: transformers.MambaConfig(vocab_size=hf.VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, use_cache=False),
    }


class Seq2Seq(torch.nn.Module):
    """T5: the ids go in as the encoder's input and as the decoder's (teacher forcing on itself)."""

    def __init__(self, config):
        super().__init__()
        self.model = transformers.T5ForConditionalGeneration(config)

    def forward(self, ids):
        return self.model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits


def model_file(family: str):
    """(model, batch, loss) for a zoo family's model file."""
    config = configs()[family]()
    model, batch, loss = hf.causal_lm(config)
    if family == "t5":

        def model():
            return Seq2Seq(config)

    return model, batch, loss

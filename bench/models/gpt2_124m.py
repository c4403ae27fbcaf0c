"""GPT-2 small (124M parameters) as an `aot` model file, for start-up benchmarks.

examples/gpt.py's classes with GPT-2 small's shapes: vocabulary 50257, context 1024, 12 layers,
12 heads, 768 dimensions, the token embedding tied to the output head (124,439,808 parameters, the
same count as Hugging Face's `gpt2`: gpt.py's separate q, k and v projections hold exactly what
GPT-2's fused c_attn holds). gpt.py is imported by path under its own module name and its config
globals are overridden before any model is made; its classes read them when they are constructed
(layer sizes, the causal-mask buffer of block_size x block_size) and in forward (head size).

The example batch is random token ids from a seeded torch.Generator (no tokenizer or data set
needed), SEQ_LEN = 256 tokens per sample to keep CPU steps bearable; `batch(n)` is deterministic,
and the first rows of `batch(n)` are the rows of `batch(m)` for m < n.

Contract names: model, batch, loss (gpt.py's cross-entropy), optimizer (AdamW, GPT-2-style
betas and weight decay, constant lr: no scheduler), max_grad_norm.
"""

import importlib.util
import sys
from pathlib import Path

import torch

SEQ_LEN = 256  # tokens per sample in batch(); the model's context (block_size) stays 1024

_GPT_PATH = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
_NAME = "aot_bench_gpt2_124m_base"  # its own module object: examples/gpt.py imported elsewhere keeps its config


def _load_gpt():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, _GPT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # GPT-2 small (read by gpt.py's classes at construction and in forward).
    module.vocab_size = 50257
    module.block_size = 1024
    module.n_layer = 12
    module.n_head = 12
    module.n_embd = 768
    sys.modules[_NAME] = module  # one copy per process, however often this model file is loaded
    return module


gpt = _load_gpt()

vocab_size, block_size, n_layer, n_head, n_embd = gpt.vocab_size, gpt.block_size, gpt.n_layer, gpt.n_head, gpt.n_embd
max_grad_norm = 1.0
loss = gpt.loss


def model():
    return gpt.GPT()


def batch(batch_size):
    """(inputs, targets), int64 [batch_size, SEQ_LEN]: random token ids, targets shifted by one."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab_size, (batch_size, SEQ_LEN + 1), generator=g, dtype=torch.int64)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer(params):
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)


if __name__ == "__main__":  # python bench/models/gpt2_124m.py: parameter count on the meta device
    with torch.device("meta"):
        m = model()
    n = sum(p.numel() for p in m.parameters())  # tied weights counted once
    print(f"{n:,} parameters; mask {tuple(m.blocks[0].attn.mask.shape)}; example batch {tuple(batch(2)[0].shape)}")

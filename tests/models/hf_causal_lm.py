"""transformers' causal language models at tiny sizes, as aot model files (tests/models/hf_*.py).

`causal_lm(config)` gives the model-file names for one transformers config: the model wraps
`AutoModelForCausalLM.from_config(config)` so its forward takes token ids and returns logits (the
module names keep transformers' own under `model.`, as a Hugging Face checkpoint has them), the
batch is random token ids, and the loss is next-token cross-entropy. Attention runs through
torch's scaled_dot_product_attention, no dropout anywhere: the runs are compared with eager DDP.
"""

import torch
import transformers
from torch.nn import functional as F

VOCAB, SEQ = 128, 16
# tiny Llama-family shapes: 4 query heads sharing 2 key/value heads (grouped-query attention)
LLAMA_SHAPES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


class CausalLM(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def causal_lm(config):
    """(model, batch, loss) for a model file."""

    def model():
        return CausalLM(config)

    def batch(batch_size):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
        return ids[:, :-1], ids[:, 1:]

    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return model, batch, loss

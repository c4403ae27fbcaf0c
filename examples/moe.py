"""A mixture-of-experts decoder: transformers' own Mixtral or Qwen3-MoE, in several sizes.

Follows the `aot` model-file contract (see examples/gpt.py). The model is
`AutoModelForCausalLM.from_config(...)`: transformers' sparse MoE blocks, whose experts are 3-D
weights (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) behind a top-k router, the layout
`--strategy ep=N` splits over N ranks (README, "Strategies"). Module names are transformers' own,
so a Hugging Face checkpoint saved by transformers v5 loads with --init-from.

Presets, picked by the environment variable AOT_SIZE (default `tiny`):

    AOT_SIZE      family     hidden  layers  heads/kv  experts  top-k  expert ffn  vocab   seq   parameters
    tiny          qwen3_moe  64      2       4/2       8        2      32          256     32    ~0.2 M (trains on CPU)
    mixtral-8x7b  mixtral    4096    32      32/8      8        2      14336       32000   2048  46.7 B (Mixtral-8x7B)
    dsv3-like     qwen3_moe  7168    61      56/8      256      8      2048        129280  2048  ~660 B

`mixtral-8x7b` is mistralai/Mixtral-8x7B-v0.1's config.json. `dsv3-like` has DeepSeek-V3's
expert layout (many small experts, top-8 of 256, 61 layers of width 7168, its first 3 layers
dense with an 18432-wide MLP, vocabulary) on Qwen3-MoE's blocks: grouped-query attention instead
of DeepSeek's latent attention, no shared expert, softmax routing; a shape for planning and
building, not DeepSeek-V3 itself.

    AOT_SIZE=mixtral-8x7b aot build examples/moe.py --topology dgx_h100 --nodes 8 --world-size 64 \\
        --strategy ep=8,fsdp=8 --batch-size 1 --no-onnx --no-eval -o artifacts/mixtral-ep8

The big presets are for building artifacts (the build records model() on fake tensors; the
runner creates the weights on the target), not for training on CPU.
"""

import os

import torch
import transformers
from torch.nn import functional as F

SIZE = os.environ.get("AOT_SIZE", "tiny")
_COMMON = dict(attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="sdpa", output_router_logits=False)
PRESETS = {
    "tiny": (
        transformers.Qwen3MoeConfig,
        dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        | dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, max_position_embeddings=64),
        32,
    ),
    "mixtral-8x7b": (
        transformers.MixtralConfig,
        dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
        | dict(num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5),
        2048,
    ),
    "dsv3-like": (
        transformers.Qwen3MoeConfig,
        dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=56, num_key_value_heads=8, head_dim=128)
        | dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432, norm_topk_prob=True)
        | dict(mlp_only_layers=[0, 1, 2], max_position_embeddings=4096, rope_theta=10000.0),
        2048,
    ),
}
if SIZE not in PRESETS:
    raise ValueError(f"AOT_SIZE={SIZE!r}: expected one of {', '.join(PRESETS)}")
_config_class, _shape, SEQ = PRESETS[SIZE]
CONFIG = _config_class(**_shape, **_COMMON)
VOCAB = CONFIG.vocab_size
max_grad_norm = 1.0


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(CONFIG)

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def model():
    return MoE()


def batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

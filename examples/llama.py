"""A Llama 3 style decoder-only transformer, in several sizes.

Follows the `aot` model-file contract (see examples/gpt.py): model(), batch(), loss(),
optimizer(), scheduler() and max_grad_norm are module-level names. The architecture is Llama 3's:
token embedding; N decoder layers of (RMSNorm -> self-attention with rotary position embeddings
(RoPE) and grouped-query attention -> residual, RMSNorm -> SwiGLU MLP -> residual); a final
RMSNorm and an lm_head; no biases anywhere, no dropout. Modules are named as in transformers'
LlamaForCausalLM (embed_tokens, layers.{i}.self_attn.q_proj/k_proj/v_proj/o_proj,
layers.{i}.mlp.gate_proj/up_proj/down_proj, input_layernorm, post_attention_layernorm, norm,
lm_head), so a Hugging Face checkpoint's weights load with model().load_state_dict(...) and
tensor-parallel plans written for it line up. RoPE uses transformers' layout (rotate the two
halves of each head), the one its Llama checkpoints are stored for.

Presets, picked by the environment variable AOT_SIZE (default `tiny`):

    AOT_SIZE  dim   layers  heads  kv heads  ffn    vocab   seq   parameters
    tiny      64    2       4      2         172    256     32    ~0.1 M   (tests: builds and trains in seconds on CPU)
    1b        2048  16      32     8         8192   128256  2048  1.24 B   (Llama-3.2-1B; embeddings tied, as published)
    8b        4096  32      32     8         14336  128256  2048  8.03 B   (Meta-Llama-3-8B)
    70b       8192  80      64     8         28672  128256  2048  70.55 B  (Meta-Llama-3-70B)

    AOT_SIZE=8b aot build examples/llama.py --world-size 8 --strategy fsdp=8 -o artifacts/llama-8b

The big presets are meant for building artifacts (the build records model() on fake tensors and
never materializes the weights; the runner creates them on the target machine), not for training
on CPU: the 8b preset's fp32 weights alone are 32 GB. Their example batch is random tokens with
a modest sequence length (2048), only to fix the static shapes; train them with --data.
"""

import math
import os

import torch
from torch import nn
from torch.nn import functional as F

# -- presets ------------------------------------------------------------------
# The 1b, 8b and 70b numbers are those of the published Hugging Face configs (config.json of
# meta-llama/Llama-3.2-1B, meta-llama/Meta-Llama-3-8B and meta-llama/Meta-Llama-3-70B:
# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# vocab_size, rope_theta, rms_norm_eps, tie_word_embeddings, rope_scaling) and the Llama 3 paper
# (arXiv:2407.21783, table 3). Llama 3.1 8B/70B are the same shapes with the llama3 rope scaling
# at factor 8 (rope_scaling below). seq is this file's choice (the example batch), not the
# models' context length.
PRESETS = {
    "tiny": dict(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=172,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_embeddings=False,
        seq_len=32,
        lr=3e-3,
        warmup_steps=5,
        decay_steps=200,
    ),
    "1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
        seq_len=2048,
        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        lr=3e-4,
        warmup_steps=2000,
        decay_steps=100000,
    ),
    "8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=500000.0,
        rope_scaling=None,
        tie_embeddings=False,
        seq_len=2048,
        lr=3e-4,
        warmup_steps=2000,
        decay_steps=100000,
    ),
    "70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        rope_theta=500000.0,
        rope_scaling=None,
        tie_embeddings=False,
        seq_len=2048,
        lr=1.5e-4,
        warmup_steps=2000,
        decay_steps=100000,
    ),
}

size = os.environ.get("AOT_SIZE", "tiny").lower()
if size not in PRESETS:
    raise ValueError(f"AOT_SIZE={size!r}: expected one of {', '.join(PRESETS)}")
config = PRESETS[size]

vocab_size = config["vocab_size"]
dim = config["dim"]
n_layers = config["n_layers"]
n_heads = config["n_heads"]  # aot checks a --strategy tp=N against this name
n_kv_heads = config["n_kv_heads"]
head_dim = dim // n_heads
ffn_dim = config["ffn_dim"]
seq_len = config["seq_len"]
norm_eps = 1e-5
max_grad_norm = 1.0
min_lr_frac = 0.1


# -- rotary position embeddings -------------------------------------------------
def rope_frequencies():
    """Inverse frequencies of head_dim / 2 rotations, with Llama 3's long-context scaling where
    the preset has it (transformers' `_compute_llama3_parameters`). Torch ops only: the build
    records model() on fake tensors, so nothing here may read a tensor's values."""
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = config["rope_scaling"]
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x, cos, sin):
    """Rotate `x` (batch, heads, seq, head_dim) by position, transformers' layout: the two halves
    x1, x2 of each head become x1*cos - x2*sin and x2*cos + x1*sin. Returns the two halves rather
    than concatenating them (torch.cat), so aot's tensor-parallel finder, which follows only ops
    that keep heads apart, can still see q/k -> o_proj through attention (see Attention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def repeat_kv(x, n_rep):
    """(batch, kv_heads, seq, d) -> (batch, kv_heads * n_rep, seq, d), each kv head repeated for
    the n_rep query heads of its group (grouped-query attention)."""
    if n_rep == 1:
        return x
    B, H, T, D = x.shape
    return x.unsqueeze(2).expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


# -- model --------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, rope_cos, rope_sin, future):
        super().__init__()
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Constants, not state (non-persistent): every layer registers the same tensors, which the
        # model computes once, so there is one copy of each whatever the depth.
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        # Head counts come from the tensors (the -1s): under tensor parallelism each rank holds
        # whole heads of q, k and v (n_heads / tp and n_kv_heads / tp of them) and runs this code
        # on those. (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)
        q = self.q_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        n_rep = q.size(1) // k.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        q1, q2 = apply_rope(q, cos, sin)
        k1, k2 = (repeat_kv(t, n_rep) for t in apply_rope(k, cos, sin))
        v = repeat_kv(v, n_rep)
        # Attention by hand rather than F.scaled_dot_product_attention (whose CPU kernels a graph
        # traced on CPU would carry to CUDA). q.k over head_dim is the sum over its two rotated
        # halves: the same scores as concatenating the halves first.
        att = (q1 @ k1.transpose(-2, -1) + q2 @ k2.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        att = att.masked_fill(self.future[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, rope_cos, rope_sin, future):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=norm_eps)
        self.self_attn = Attention(rope_cos, rope_sin, future)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=norm_eps)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        # RoPE angles of positions 0..seq_len-1 (cos and sin of each half-head frequency) and the
        # causal mask (True above the diagonal: the future a position may not see), from torch ops.
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), rope_frequencies())
        cos, sin = angles.cos(), angles.sin()
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(DecoderLayer(cos, sin, future) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        if config["tie_embeddings"]:
            self.lm_head.weight = self.embed_tokens.weight  # Llama-3.2-1B ties them

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # logits (batch, seq, vocab_size)


# -- contract -----------------------------------------------------------------
def model():
    return Llama()


def batch(batch_size):
    """Random tokens from a generator seeded 0 (the same batch every time); targets are the next
    token of each position."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g, dtype=torch.int64)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def loss(outputs, targets):
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=config["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def lr_lambda(step):
    """Multiplier on the base lr: linear warmup, then cosine decay to min_lr_frac."""
    warmup, decay = config["warmup_steps"], config["decay_steps"]
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (decay - warmup))
    return min_lr_frac + (1.0 - min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

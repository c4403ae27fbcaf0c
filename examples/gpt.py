"""A tiny character-level GPT (decoder-only transformer), in the spirit of nanoGPT.

Follows the `aot` model-file contract (see examples/mlp.py): model(), batch(),
loss(), optimizer(), scheduler() and max_grad_norm are module-level names.
`dropout` is 0 here, so a training step is a deterministic function of its inputs; set it and
dropout follows attention's softmax and each residual branch, as in nanoGPT.
"""

import math
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# -- config -------------------------------------------------------------------
vocab_size = 96  # newline + printable ASCII 32..126
block_size = 64  # context length
n_layer = 2
n_head = 4
n_embd = 64
max_grad_norm = 1.0
warmup_steps = 5
decay_steps = 200  # cosine decay from step 0 of training to `decay_steps`
min_lr_frac = 0.1
dropout = 0.0  # 0: no dropout modules at all (the graph has no random ops)

text_path = Path(__file__).parent / "data" / "tinytext.txt"

# -- tokenizer ----------------------------------------------------------------
# newline -> 0, chr(32..126) -> 1..95, anything else -> the id of '?'.
_unknown = ord("?") - 31


def encode(text):
    return [0 if c == "\n" else ord(c) - 31 if 32 <= ord(c) <= 126 else _unknown for c in text]


def decode(ids):
    return "".join("\n" if i == 0 else chr(i + 31) for i in ids)


# -- model --------------------------------------------------------------------
def _dropout():
    return nn.Dropout(dropout) if dropout else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        # Separate q, k and v projections, and head counts read from the tensors (the -1 in the
        # views): under tensor parallelism each rank holds whole heads of q, k and v and the same
        # code runs on its n_head / tp of them.
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        # Non-persistent: the mask is a constant, not state to checkpoint.
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)
        self.attn_drop, self.resid_drop = _dropout(), _dropout()

    def forward(self, x):
        B, T, _ = x.shape
        head_size = n_embd // n_head
        # (B, T, heads * head_size) -> (B, heads, T, head_size)
        q, k, v = (f(x).view(B, T, -1, head_size).transpose(1, 2) for f in (self.q, self.k, self.v))
        # Attention by hand rather than F.scaled_dot_product_attention: SDPA lowers to
        # backend-specific kernels, and a graph traced on CPU must also run on CUDA.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_size))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = _dropout()

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections down by depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # logits (B, T, vocab_size)


# -- contract -----------------------------------------------------------------
@lru_cache(maxsize=None)
def data():
    """The shipped text, encoded, as a 1-D int64 tensor."""
    return torch.tensor(encode(text_path.read_text(encoding="ascii")), dtype=torch.int64)


def model():
    return GPT()


def batch(batch_size):
    # Fixed offsets i * block_size (wrapping if the text is too short), so the
    # example batch is always the same.
    d = data()
    n = len(d) - block_size - 1
    offsets = [(i * block_size) % n for i in range(batch_size)]
    inputs = torch.stack([d[o : o + block_size] for o in offsets])
    targets = torch.stack([d[o + 1 : o + 1 + block_size] for o in offsets])
    return inputs, targets


def loss(outputs, targets):
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def lr_lambda(step):
    """Multiplier on the base lr: linear warmup, then cosine decay to min_lr_frac."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return min_lr_frac + (1.0 - min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

"""A Llama 3 written as torchtitan writes it (models/llama3/model.py), at a tiny size: the idioms of
issue #40 as a user copies them. Weights from `nn.init.trunc_normal_` (torch's rejection sampler),
rotary embeddings through complex numbers (`torch.view_as_complex` on a complex `freqs_cis`
buffer), every block under `torch.utils.checkpoint(..., use_reentrant=False)` (set CHECKPOINT to
None for none, "reentrant" for the old kind), and an optimizer over the parameters that require
grad (torchtitan's and most training scripts' `filter(lambda p: p.requires_grad, ...)`).
No dropout: runs are compared with eager PyTorch.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, SEQ, DIM, N_LAYERS, N_HEADS, N_KV_HEADS = 128, 16, 64, 2, 4, 2
CHECKPOINT = "non_reentrant"  # None, "non_reentrant" or "reentrant"


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads = N_HEADS, N_KV_HEADS
        self.n_rep = N_HEADS // N_KV_HEADS
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward(hidden_dim=4 * DIM)
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // N_HEADS, SEQ * 2), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i) for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.init_weights()

    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = DIM**-0.5
        cutoff_factor = 3
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std, a=-cutoff_factor * final_out_std, b=cutoff_factor * final_out_std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            if CHECKPOINT:
                h = checkpoint(layer, h, self.freqs_cis, use_reentrant=CHECKPOINT == "reentrant")
            else:
                h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def model():
    return Transformer()


def batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def optimizer(params):
    return torch.optim.AdamW(filter(lambda p: p.requires_grad, params), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

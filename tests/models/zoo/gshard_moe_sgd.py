"""A mixture of experts written as GShard, Switch Transformer and DeepSpeed-MoE write it: the
experts an nn.ModuleList, each token's top-k choices given rows of a static [E, C, H] dispatch
buffer by a cumulative sum over the routing mask (choice-major: every first choice before any
second), `expert(buffer[e])` called once per expert by the block's own loop, and the results
combined by an einsum with the routing weights. C = the tokens of one rank's batch, so no choice
is dropped (the model's own capacity, computed from the batch it is given: per rank under data
parallelism, as eager DDP computes it).

Trained by SGD with clipping, as tests/models/zoo/qwen3_moe_sgd.py is: an expert gradient divided
by the wrong number of ranks, or a norm summed over the wrong groups, moves the weights. Expert
parallelism's tests (tests/test_expert_parallel.py) split its experts over ep ranks."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, EXPERTS, TOP_K, SEQ, LAYERS, HEADS = 64, 32, 4, 2, 16, 2, 4
CAPACITY = None  # rows per expert; None: the tokens of the batch the block is given (dropless)
max_grad_norm = 0.5


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        tokens = x.reshape(-1, DIM)
        capacity = CAPACITY or tokens.shape[0]
        weights, chosen = F.softmax(self.gate(tokens), dim=-1).topk(TOP_K, dim=-1)  # [T, K]
        mask = F.one_hot(chosen, EXPERTS)  # [T, K, E]
        choice_major = mask.transpose(0, 1).reshape(-1, EXPERTS)
        position = ((choice_major.cumsum(0) - 1) * choice_major).reshape(TOP_K, -1, EXPERTS).transpose(0, 1)
        kept = mask * (position < capacity)
        slots = F.one_hot(position.clamp(max=capacity - 1), capacity) * kept.unsqueeze(-1)  # [T, K, E, C]
        dispatch = slots.sum(1).to(x.dtype)  # [T, E, C]
        combine = (slots * weights[..., None, None]).sum(1).to(x.dtype)
        buffer = torch.einsum("tec,th->ech", dispatch, tokens)  # [E, C, H]
        out = torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts)])
        return torch.einsum("tec,ech->th", combine, out).reshape_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.moe = nn.LayerNorm(DIM), MoE()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    return Model()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)

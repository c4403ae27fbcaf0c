"""A model initialized with every nn.init initializer that draws or reads values, for
tests/test_init_program.py: trunc_normal_ (torch's rejection sampler, whose number of draws depends
on the values drawn; both of its branches: a wide interval and a narrow one, and imported by name
as torchtitan and timm do), orthogonal_ (a QR of a draw), sparse_ (a permutation per column), the
kaiming and xavier draws, dirac_ and eye_. The replayed init program must be eager's, bit for bit."""

import torch
from torch import nn
from torch.nn.init import trunc_normal_


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(16, 32)
        self.narrow = nn.Linear(32, 32)
        self.orthogonal = nn.Linear(32, 32)
        self.sparse = nn.Linear(32, 16)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.eye = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 8)
        trunc_normal_(self.wide.weight, std=0.02)
        nn.init.trunc_normal_(self.narrow.weight, mean=0.0, std=1.0, a=-0.1, b=0.1)  # p < 0.3: the other sampler
        nn.init.orthogonal_(self.orthogonal.weight)
        nn.init.sparse_(self.sparse.weight, sparsity=0.5)
        nn.init.dirac_(self.conv.weight)
        nn.init.eye_(self.eye.weight)
        nn.init.xavier_normal_(self.head.weight)
        nn.init.kaiming_normal_(self.narrow.weight[:8], nonlinearity="relu")  # a view of a weight, drawn again

    def forward(self, x):
        h = torch.relu(self.wide(x))
        h = torch.relu(self.narrow(h)) + self.orthogonal(h)
        h = self.sparse(h)
        h = h + self.conv(h.view(-1, 4, 2, 2)).flatten(1)
        return self.head(self.eye(h))


def model():
    return Net()


def batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 8, (batch_size,), generator=g)

"""fp16 training whose loss scale overflows at known steps: GradScaler's dynamics in a few steps.

The initial scale (2^19) is too large for this model's fp16 gradients, so the first steps overflow
and are skipped while the scale halves; growth_interval=2 then doubles it after two clean steps,
which overflows again. A step schedule shows whether skipped steps hold the learning rate back.
"""

import torch
from torch import nn

precision = "fp16"
grad_scaler = {"init_scale": 2.0**19, "growth_interval": 2}


def model():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))


def batch(batch_size):
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch_size, 16, generator=g) * 4, torch.randint(0, 8, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

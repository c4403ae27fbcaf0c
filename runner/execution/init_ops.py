"""Initializers an init program records as one op because their draws depend on the values drawn.

torch's `nn.init.trunc_normal_` (torch 2.13) is a rejection sampler: it draws, then draws again
for the elements outside [a, b] until none are, so how many numbers it takes from the generator
depends on the numbers themselves. No static program of `normal_` calls can replay that. The init
program records the call instead, as `aot_init::trunc_normal_`, an op the runner owns (artifacts/
FORMAT.md "Init program"), whose kernel is torch's own sampler: replayed after the same seed it
draws exactly what eager construction draws, on the same generator, in the same order.

Importing this module registers the op (the build imports it to record, the runner to replay).
"""

from __future__ import annotations

import torch
import torch.nn.init

NAMESPACE = "aot_init"

# torch's sampler, kept before the build redirects nn.init's module attribute to the recorded op
# (aot/capture/training_state.py): the kernel must run the real one.
_TORCH_TRUNC_NORMAL = torch.nn.init._no_grad_trunc_normal_

_library = torch.library.Library(NAMESPACE, "DEF")
_library.define("trunc_normal_(Tensor(a!) self, float mean, float std, float a, float b) -> Tensor(a!)")


def _trunc_normal_cpu(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> torch.Tensor:
    with torch.no_grad():
        return _TORCH_TRUNC_NORMAL(tensor, mean, std, a, b)


def _trunc_normal_meta(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> torch.Tensor:
    return tensor  # shapes only: the values are drawn where the program is replayed


_library.impl("trunc_normal_", _trunc_normal_cpu, "CPU")
_library.impl("trunc_normal_", _trunc_normal_meta, "Meta")

trunc_normal_ = torch.ops.aot_init.trunc_normal_.default

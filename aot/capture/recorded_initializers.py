"""nn.init's value-dependent initializers, recorded as the runner's init ops while model() is traced.

`nn.init.trunc_normal_` loops until no drawn value lies outside [a, b] (runner/execution/init_ops.py says
why no static program can replay that); on fake tensors its loop cannot even run. While the build
records model(), torch.nn.init's sampler is redirected to `aot_init::trunc_normal_`, whose
kernel is that same sampler: the init program calls it where eager construction did, so the
replay draws what eager draws. `trunc_normal_` finds its sampler through nn.init's module
globals, so this catches `from torch.nn.init import trunc_normal_` too.
"""

from __future__ import annotations

import contextlib

import torch.nn.init

from aot.capture.model_file import calling_line
from aot.errors import AotError
from runner.execution import init_ops


def _recorded_trunc_normal(tensor, mean, std, a, b, generator=None):
    if generator is not None:
        raise AotError(
            f"{calling_line()}nn.init.trunc_normal_(..., generator=...) draws from a generator of the model's own, which an "
            "artifact cannot replay (the runner seeds torch's global generator); drop the generator argument"
        )
    if tensor.is_meta:
        return tensor
    return init_ops.trunc_normal_(tensor, float(mean), float(std), float(a), float(b))


@contextlib.contextmanager
def recorded_initializers():
    """While active, nn.init.trunc_normal_ (and every caller of its sampler) records one op."""
    saved = torch.nn.init._no_grad_trunc_normal_
    torch.nn.init._no_grad_trunc_normal_ = _recorded_trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = saved

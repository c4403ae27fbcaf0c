"""Forward and loss under another device's autocast rules, traced on a machine without that device.

CUDA's autocast policy (which ops run in bf16/fp16, which are kept in or upcast to fp32) applies
only to tensors on CUDA. Fake tensors can say `device="cuda"` on a CPU-only torch, and forward
ops on them trace with CUDA's casts (torch-notes: "CUDA's autocast rules on a CPU-only build"),
but autograd on them aborts the process: its engine asks torch for CUDA's device guard, which a
CPU-only build lacks. So forward and loss are traced alone, without autograd, on fake CUDA
tensors under CUDA's autocast: the graph holds CUDA's casts as explicit `_to_copy` nodes. Its
devices are then rewritten to the CPU and the whole step runs it in place of the model:
backward differentiates the explicit casts like any op. The step's graph is therefore the same
on any build machine, GPU or not.

A few of torch's Python entry points cannot run on such tensors: their bindings take CUDA's
device guard before dispatch (indexing `x[:, :T]` and assignment to it, `~mask`, `.contiguous()`;
found by trying the common ones). `_DeviceFree` gives each the aten ops torch's own binding
dispatches (select, slice, unsqueeze, index, copy_, index_put_, bitwise_not, clone), through the
dispatcher, which needs no guard. Creating a tensor from Python data on the device
(`torch.tensor([...], device=x.device)`) still fails and is reported at the model's line.

Two differences from tracing on a GPU, both without effect on the numbers: autocast's cache of
cast weights applies to leaves that require grad, so a weight used twice (tied embeddings) is
cast twice; and scaled_dot_product_attention is recorded as its math decomposition, the only
kernel torch can choose without a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from aot.capture.trace_logs import quiet_trace_logs


def trace_under_rules(fn: Callable, examples: list[torch.Tensor], device: str, autocast) -> torch.fx.GraphModule:
    """`fn(*tensors)` (forward and loss) traced on fake tensors like `examples` but on `device`,
    under `autocast` (a context manager giving that device's rules); returned as a graph that runs
    on the CPU: every device it names is the CPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in examples]

    def under_rules(*tensors):
        with autocast():
            return fn(*tensors)

    with torch.no_grad(), quiet_trace_logs():
        gm = make_fx(lambda *t: _indexed(under_rules, *t), tracing_mode="fake")(*fakes)
    cpu = torch.device("cpu")
    for node in gm.graph.nodes:
        node.args = _on_cpu(node.args, cpu)
        node.kwargs = _on_cpu(node.kwargs, cpu)
    gm.recompile()
    return gm


def _on_cpu(value, cpu: torch.device):
    if isinstance(value, torch.device):
        return cpu
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v, cpu) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v, cpu) for k, v in value.items()}
    return value


def _indexed(fn, *args):
    with _DeviceFree():
        return fn(*args)


aten = torch.ops.aten


class _DeviceFree(TorchFunctionMode):
    """The Tensor methods whose bindings take a device guard, as the aten ops they dispatch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
        if on_device and func is torch.Tensor.__getitem__:
            return _getitem(args[0], args[1])
        if on_device and func is torch.Tensor.__setitem__:
            return _setitem(*args)
        if on_device and func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        if on_device and func is torch.Tensor.contiguous:
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            t = args[0]
            return t if t.is_contiguous(memory_format=fmt) else aten.clone.default(t, memory_format=fmt)
        return func(*args, **kwargs)


def _getitem(t: torch.Tensor, index) -> torch.Tensor:
    index = index if isinstance(index, tuple) else (index,)
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in index if i is not None and i is not Ellipsis)
    if consumed > t.dim():
        raise IndexError(f"too many indices for tensor of dimension {t.dim()}")
    dim, advanced = 0, {}
    for i in index:
        if i is None:
            t = aten.unsqueeze.default(t, dim)
            dim += 1
        elif i is Ellipsis:  # skips the dimensions no later index consumes
            dim = t.dim() - _consumed_after(index)
        elif isinstance(i, bool):
            raise IndexError("indexing with a Python bool is not supported here")
        elif isinstance(i, (int, torch.SymInt)):
            t = aten.select.int(t, dim, i)
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            if i.start is not None or i.stop is not None or step != 1:
                t = aten.slice.Tensor(t, dim, i.start, i.stop, step)
            dim += 1
        elif isinstance(i, torch.Tensor):
            if i.dtype == torch.bool:
                raise IndexError("boolean-mask indexing is data-dependent and cannot be traced")
            advanced[dim] = i
            dim += 1
        else:
            raise IndexError(f"unsupported index {type(i).__name__}")
    if advanced:
        t = aten.index.Tensor(t, [advanced.get(d) for d in range(max(advanced) + 1)])
    return t


def _consumed_after(index: tuple) -> int:
    """Dimensions the indices after the Ellipsis consume."""
    at = next(k for k, i in enumerate(index) if i is Ellipsis)
    return sum(1 for i in index[at + 1:] if i is not None)


def _setitem(t: torch.Tensor, index, value) -> None:
    """`t[index] = value`: copy_ into the view basic indexing gives, index_put_ for tensor indices."""
    index = index if isinstance(index, tuple) else (index,)
    if not isinstance(value, torch.Tensor):
        value = aten.scalar_tensor.default(value, dtype=t.dtype, device=t.device)
    if any(isinstance(i, torch.Tensor) for i in index):
        if not all(isinstance(i, torch.Tensor) for i in index):
            raise IndexError("assignment mixing tensor and other indices is not supported here")
        aten.index_put_.default(t, list(index), value)
        return
    aten.copy_.default(_getitem(t, index), value)

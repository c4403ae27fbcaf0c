"""Autocast with another device's rules, traced on a machine without that device.

CUDA's autocast policy (which ops run in bf16/fp16, which are kept in or upcast to fp32) applies
only to tensors on CUDA. Fake tensors can say `device="cuda"` on a CPU-only torch, and forward
ops on them trace with CUDA's casts (torch-notes: "CUDA's autocast rules on a CPU-only build"),
but autograd on them aborts the process: its engine asks torch for CUDA's device guard, which a
CPU-only build lacks. So the step keeps its CPU tensors (and DTensors over them, under tensor
parallelism) and `TargetAutocast` applies CUDA's rules call by call: each torch call of forward
and loss that computes on floating tensors is traced alone, without autograd, on fake CUDA
tensors like its arguments under CUDA's autocast, and what it recorded (CUDA's explicit casts
and the ops) runs on the real arguments in its place. Autograd differentiates the casts like any
op, DTensor shards them like any op, and the step's graph is the same on any build machine.

A few of torch's Python entry points cannot run on fake CUDA tensors: their bindings take CUDA's
device guard before dispatch (indexing `x[:, :T]` and assignment to it, `~mask`, `.contiguous()`;
found by trying the common ones). `_DeviceFree` gives each the aten ops torch's own binding
dispatches (select, slice, unsqueeze, index, copy_, index_put_, bitwise_not, clone), through the
dispatcher, which needs no guard. Creating a tensor from Python data on the device
(`torch.tensor([...], device=x.device)`) inside a traced call still fails and is reported at the
model's line.

Two differences from tracing on a GPU, both without effect on the numbers: autocast's cache of
cast weights applies to leaves that require grad, so a weight used twice (tied embeddings) is
cast twice; and scaled_dot_product_attention is recorded as the runner's fused operator
(aot/capture/fused_attention.py), or, where that cannot compute a call (dropout, tensor-parallel
DTensors), as its math decomposition, the only kernel torch can choose without a GPU.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode


def _on_cpu(value, cpu: torch.device):
    if isinstance(value, torch.device):
        return cpu
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v, cpu) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v, cpu) for k, v in value.items()}
    return value


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
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in index if i is not None and i is not Ellipsis)
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
    return sum(1 for i in index[at + 1 :] if i is not None)


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


# Calls autocast never changes (shapes, views, creation from sizes, ...): run as they are, unprobed.
_UNCHANGED = {
    "__get__",
    "size",
    "dim",
    "stride",
    "numel",
    "__len__",
    "__iter__",
    "__repr__",
    "__format__",
    "__bool__",
    "item",
    "tolist",
    "element_size",
    "is_floating_point",
    "is_contiguous",
    "data_ptr",
    "storage_offset",
    "view",
    "reshape",
    "transpose",
    "permute",
    "t",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "expand",
    "split",
    "chunk",
    "narrow",
    "view_as",
    "expand_as",
    "reshape_as",
    "detach",
    "requires_grad_",
    "__getitem__",
    "__setitem__",
    "contiguous",
    "tensor",
    "arange",
    "zeros",
    "ones",
    "full",
    "empty",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "__invert__",
    "masked_fill",
    "masked_fill_",
    "tril",
    "triu",
}
_COMPUTE_MODULES = {
    "torch",
    "torch.functional",
    "torch.nn.functional",
    "torch._C._nn",
    "torch._C._linalg",
    "torch._C._special",
    "torch.special",
    "torch.linalg",
}


class TargetAutocast(TorchFunctionMode):
    """Autocast with `device`'s rules over tensors of another device (the CPU's, or DTensors on
    it), call by call: each torch call that computes on floating tensors is traced alone on fake
    tensors of `device` (same shapes, strides and dtypes) under that device's autocast, without
    autograd; what it recorded (the device's casts, then the ops) is run on the real arguments in
    its place, so autograd, DTensor's sharding and the step's trace see explicit casts. Calls are
    traced once per signature."""

    def __init__(self, device: str, dtype: torch.dtype, autocast):
        super().__init__()
        self.device, self.dtype, self.autocast = device, dtype, autocast
        self._graphs: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _computes(func):
            return func(*args, **kwargs)
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        if not any(flat[i].is_floating_point() for i in where):
            return func(*args, **kwargs)
        key = (func, str(spec), tuple((str(a.dtype), tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else repr(a) for a in flat))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._trace(func, flat, spec, where)
        return graph(*[flat[i] for i in where])

    def _trace(self, func, flat, spec, where) -> torch.fx.GraphModule:
        from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        def call(*tensors):
            leaves = list(flat)
            for i, t in zip(where, tensors):
                leaves[i] = t
            call_args, call_kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
            with self.autocast(), _DeviceFree():
                return func(*call_args, **call_kwargs)

        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            mode = FakeTensorMode()
            with mode:
                fakes = [torch.empty_strided(tuple(flat[i].shape), tuple(flat[i].stride()), dtype=flat[i].dtype, device=self.device) for i in where]
            with torch.no_grad():
                gm = make_fx(call, tracing_mode="fake")(*fakes)
        cpu = torch.device("cpu")
        for node in gm.graph.nodes:
            node.args = _on_cpu(node.args, cpu)
            node.kwargs = _on_cpu(node.kwargs, cpu)
        gm.recompile()
        return gm


def _computes(func) -> bool:
    """Whether `func` is one of torch's computing calls (a function of torch's namespaces or a
    Tensor method) that autocast may change."""
    if type(func).__name__ in ("OpOverload", "OpOverloadPacket"):  # torch's internals (DTensor, collectives)
        return False
    name = getattr(func, "__name__", "")
    if name in _UNCHANGED:
        return False
    qualname = getattr(func, "__qualname__", "") or ""
    return getattr(func, "__module__", None) in _COMPUTE_MODULES or qualname.startswith(("TensorBase.", "Tensor."))


def math_attention(graph: torch.fx.Graph) -> tuple[int, int, tuple[int, ...] | None]:
    """(calls, bytes, one shape) of the attention scores a graph makes as scaled_dot_product_attention's
    math decomposition (its softmax is `_safe_softmax`, a user's own `softmax` is `_softmax`): on a
    GPU torch would run a fused kernel that keeps no B x H x S x S scores for backward."""
    calls, size, shape = 0, 0, None
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten._safe_softmax.default:
            val = node.meta.get("val")
            calls += 1
            if isinstance(val, torch.Tensor):
                size += val.numel() * val.element_size()
                shape = tuple(val.shape)
    return calls, size, shape

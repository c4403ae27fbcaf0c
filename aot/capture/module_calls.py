"""Which module call every forward node of a captured step comes from.

make_fx records aten ops, not modules. Recomputing "every call of `blocks.*`" (model-file
`recompute`) needs to know which ops a call made and which of its values leave it, so while the
step is traced, hooks on every submodule keep a stack of the calls in progress, and
torch.fx.traceback.annotate stores it in each node made meanwhile: node.meta["custom"][MODULE_CALLS]
= ((dotted module name, call number), ...), outermost first. A module called twice (weight tying,
a shared block) gets two call numbers.

`torch.utils.checkpoint(fn, ..., use_reentrant=False)` (transformers' gradient checkpointing,
torchtitan's activation checkpointing) is the user's own recomputation request. Traced as torch
runs it, its recomputation would happen inside backward with the module's own (fake) parameters
swapped back in, and a dropout inside would draw a second mask. So while the step is traced it
runs `fn` once, as a plain call, and its nodes carry node.meta["custom"][CHECKPOINT_CALLS] =
(call number, ...), outermost first: aot.passes.recompute then recomputes each such call from its
inputs as it does the model file's `recompute` (random draws stay saved, so it is bit-identical
to keeping everything). The reentrant variant runs its own autograd.Function; it is refused in
one line that says to pass use_reentrant=False.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch
import torch.fx.traceback as fx_traceback

from aot.capture.model_file import calling_line
from aot.errors import AotError

MODULE_CALLS = "aot_module_calls"
CHECKPOINT_CALLS = "aot_checkpoint_calls"
BLOCK_BACKWARD = "aot_block_backward"  # node.meta["custom"] key: the block whose backward made the node
STAMPED_BLOCK = "aot_stamped_block"  # node.meta["custom"] key: the block the planner wrote a node out for (aot/plan/repeated_blocks.py)

# The dotted name of a ModuleList of repeated blocks whose backward regions a trace annotates
# (`annotating_blocks`, around the planner's traces of a model cut to a few blocks).
annotated_blocks: ContextVar[str | None] = ContextVar("annotated_blocks", default=None)


@contextmanager
def annotating_blocks(blocks: str):
    """Traces made meanwhile annotate each block's backward of the list `blocks` (BLOCK_BACKWARD)."""
    token = annotated_blocks.set(blocks)
    try:
        yield
    finally:
        annotated_blocks.reset(token)


class _ReentrantCheckpoint:
    """Stands in for torch.utils.checkpoint.CheckpointFunction while a step is traced."""

    @staticmethod
    def apply(function, *args):
        raise AotError(
            f"{calling_line()}torch.utils.checkpoint(..., use_reentrant=True) (torch's default where use_reentrant is not "
            "given) reruns the forward inside its own backward, which a traced step cannot hold; pass "
            "use_reentrant=False (transformers: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            '{"use_reentrant": False})), or drop it and set the model file\'s recompute (README, Recomputation)'
        )


@contextmanager
def _checkpoint_calls():
    """torch.utils.checkpoint's calls run as plain calls, their nodes annotated (module docstring).
    torch's checkpoint() looks both of these up in its module's globals when called, so a
    checkpoint function imported by name (`from torch.utils.checkpoint import checkpoint`) is
    caught too."""
    import torch.utils.checkpoint as torch_checkpoint

    stack: list[int] = []
    numbers = itertools.count()

    def region(function, *args, **kwargs):  # the generator checkpoint() runs around function
        stack.append(next(numbers))
        try:
            with fx_traceback.annotate({CHECKPOINT_CALLS: tuple(stack)}):
                yield
        finally:
            stack.pop()

    replaced = {"_checkpoint_without_reentrant_generator": region, "CheckpointFunction": _ReentrantCheckpoint}
    saved = {name: getattr(torch_checkpoint, name) for name in replaced}
    for name, value in replaced.items():
        setattr(torch_checkpoint, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch_checkpoint, name, value)


@contextmanager
def annotate_module_calls(model: torch.nn.Module):
    stack, contexts, handles = [], [], []
    numbers = itertools.count()

    def enter(name):
        def hook(module, args):
            stack.append((name, next(numbers)))
            context = fx_traceback.annotate({MODULE_CALLS: tuple(stack)})
            context.__enter__()
            contexts.append(context)

        return hook

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)
        stack.pop()

    for name, module in model.named_modules():
        if name:  # the root call is the whole forward: nothing to tell apart
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    blocks = annotated_blocks.get()
    backward: list = []  # the open annotation of the block whose backward is being traced
    if blocks is not None:
        handles += _block_backward_hooks(model.get_submodule(blocks), backward)
    try:
        with fx_traceback.preserve_node_meta(), _checkpoint_calls():
            try:
                yield
            finally:
                while backward:  # a trace that raised in a block's backward
                    backward.pop().__exit__(None, None, None)
    finally:
        for handle in handles:
            handle.remove()
        while contexts:  # a forward that raised: close what its hooks opened
            contexts.pop().__exit__(None, None, None)


def _first_grad_tensor(values) -> torch.Tensor | None:
    for v in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


def _block_backward_hooks(blocks: torch.nn.Module, open_region: list) -> list:
    """Hooks annotating the nodes each block's backward makes with BLOCK_BACKWARD = its index.
    Autograd finishes block i's backward before block i-1's starts (block i-1's output gradient
    is complete only then), so the backward of block i runs from the moment the gradient of the
    last block's output (i = last) or of block i+1's input is complete to the moment the gradient
    of block i's input is: pre-hooks on the autograd nodes that made those values (they run once
    the value's gradient is complete; a tensor hook would go through the target's autocast
    function mode) open and close the annotation."""
    children = list(blocks.children())
    last = len(children) - 1

    def region(i):
        while open_region:
            open_region.pop().__exit__(None, None, None)
        if i >= 0:
            if i == last:  # the backward's end closes the first block's region where its input needs no gradient
                torch.autograd.Variable._execution_engine.queue_callback(lambda: region(-1))
            context = fx_traceback.annotate({BLOCK_BACKWARD: i})
            context.__enter__()
            open_region.append(context)

    def on_input(i):
        def hook(module, args, kwargs):
            x = _first_grad_tensor(list(args) + list(kwargs.values()))
            if x is not None and x.grad_fn is not None:
                x.grad_fn.register_prehook(lambda grads: region(i - 1))

        return hook

    def on_last_output(module, args, output):
        y = _first_grad_tensor(output)
        if y is not None and y.grad_fn is not None:
            y.grad_fn.register_prehook(lambda grads: region(last))

    handles = [child.register_forward_pre_hook(on_input(i), with_kwargs=True) for i, child in enumerate(children)]
    if children:
        handles.append(children[-1].register_forward_hook(on_last_output))
    return handles


def block_backward_of(node) -> int | None:
    """The block whose backward made `node` (annotated_blocks), or None."""
    return node.meta.get("custom", {}).get(BLOCK_BACKWARD)


def checkpoint_call_of(node) -> int | None:
    """The outermost torch.utils.checkpoint call `node` was made in, by number; None outside every one."""
    calls = node.meta.get("custom", {}).get(CHECKPOINT_CALLS, ())
    return calls[0] if calls else None


def layer_of(node) -> str | None:
    """The layer a node belongs to: its outermost call of a numbered child (`blocks.3`, `0`: a
    ModuleList's or Sequential's), by name; None outside every layer."""
    for name, _ in node.meta.get("custom", {}).get(MODULE_CALLS, ()):
        if name.rsplit(".", 1)[-1].isdigit():
            return name
    return None


@contextmanager
def forwards_replaced(forwards: dict[torch.nn.Module, Callable]):
    """While the step is traced, each module's call runs the given function instead of its class's
    forward (SyncBatchNorm's statistics over the data ranks, experts dispatched over ep): an
    instance attribute in front of the class's forward, deleted after, which uncovers it again.
    `Module.__call__` still runs, so hooks (module-call annotations, transformers' output
    recorders) see the call as before."""
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.forward

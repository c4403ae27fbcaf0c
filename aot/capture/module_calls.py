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

import torch
import torch.fx.traceback as fx_traceback

from aot.capture.model_file import calling_line
from aot.errors import AotError

MODULE_CALLS = "aot_module_calls"
CHECKPOINT_CALLS = "aot_checkpoint_calls"


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
    try:
        with fx_traceback.preserve_node_meta(), _checkpoint_calls():
            yield
    finally:
        for handle in handles:
            handle.remove()
        while contexts:  # a forward that raised: close what its hooks opened
            contexts.pop().__exit__(None, None, None)


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

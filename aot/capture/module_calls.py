"""Which module call every forward node of a captured step comes from.

make_fx records aten ops, not modules. Recomputing "every call of `blocks.*`" (model-file
`recompute`) needs to know which ops a call made and which of its values leave it, so while the
step is traced, hooks on every submodule keep a stack of the calls in progress, and
torch.fx.traceback.annotate stores it in each node made meanwhile: node.meta["custom"][MODULE_CALLS]
= ((dotted module name, call number), ...), outermost first. A module called twice (weight tying,
a shared block) gets two call numbers.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch
import torch.fx.traceback as fx_traceback

MODULE_CALLS = "aot_module_calls"


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
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for handle in handles:
            handle.remove()
        while contexts:  # a forward that raised: close what its hooks opened
            contexts.pop().__exit__(None, None, None)


def layer_of(node) -> str | None:
    """The layer a node belongs to: its outermost call of a numbered child (`blocks.3`, `0`: a
    ModuleList's or Sequential's), by name; None outside every layer."""
    for name, _ in node.meta.get("custom", {}).get(MODULE_CALLS, ()):
        if name.rsplit(".", 1)[-1].isdigit():
            return name
    return None

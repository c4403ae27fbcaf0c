"""Calls a trace records that cannot take part in the step: dropped before anything is stored.

make_fx records every operator called while it traces, also one a library calls on itself when a
model's constructor or forward first imports it: torchaudio asks `torch.ops._torchaudio.cuda_version()`
on import, and transformers' GPT-2 imports torchaudio lazily where it is installed (seen on the
H200 machine). The artifact would then name an operator the runner cannot resolve, since it
never imports model-side libraries. Such a call reads no graph value, returns no tensor and
nothing uses its result: it cannot change the step, so it goes. Anything else stays, random draws
included (they return tensors) and asserts (they read graph values).
"""

from __future__ import annotations

import torch


def _returns_no_tensor(target: torch._ops.OpOverload) -> bool:
    return not any("Tensor" in str(r.type) for r in target._schema.returns)  # Tensor, Tensor?, Tensor[]


def is_inert(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and not node.users
        and not node.all_input_nodes
        and not target._schema.is_mutable
        and _returns_no_tensor(target)
    )


def drop_inert_calls(gm: torch.fx.GraphModule) -> int:
    """Erase `gm`'s inert calls (see the module docstring); returns how many."""
    inert = [n for n in gm.graph.nodes if is_inert(n)]
    for node in inert:
        gm.graph.erase_node(node)
    if inert:
        gm.recompile()
    return len(inert)

"""Tensor-parallel plans as a user reads them: module names with their layer numbers folded
(`layers.*.mlp.up_proj (x32)`), one line per reason a Linear stays whole, and the matrices no
Linear holds (mixture-of-experts weights) that stay whole on every rank."""

from __future__ import annotations

import re

from torch import nn


def _fold(text: str) -> str:
    """Layer numbers in module paths replaced by `*`: `layers.3.mlp` -> `layers.*.mlp`."""
    return re.sub(r"\.\d+(?=\.|\s|$)", ".*", text)


def _counted(items) -> dict:
    """Each distinct item with how often it occurs, in first-seen order."""
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def summarize(names) -> str:
    """Module names with their layer numbers folded: `layers.*.mlp.up_proj (x32)`."""
    return ", ".join(f"{p} (x{c})" if c > 1 else p for p, c in _counted(_fold(n) for n in names).items())


def summarize_whole(whole: dict[str, str]) -> list[str]:
    """One line per reason, naming the Linears it leaves whole, layer numbers folded."""
    by_reason: dict[str, list[str]] = {}
    for name, why in whole.items():
        by_reason.setdefault(_fold(why), []).append(name)
    return [f"{summarize(names)}: {why}" for why, names in by_reason.items()]


def unsplit_weights(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """Lines for the matrices tensor parallelism cannot split because no Linear holds them
    (mixture-of-experts weights kept as one 3-d tensor per projection, say), layer numbers folded.
    Embeddings are not listed: every rank keeps the whole vocabulary by design."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or path in plan:
            continue
        weights = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
        if weights:
            experts = "expert" in (path + type(module).__name__).lower()
            kind = "mixture-of-experts weights" if experts else f"weights of a {type(module).__name__}, not a Linear"
            found[path or "the model"] = f"{kind} ({', '.join(weights)}) stay whole on every tp rank"
    return summarize_whole(found)

"""The model's own state_dict keys for stored tensors, through tied names (`aliases`) and stacked
experts weights (`stacked`, format 8): under expert parallelism a ModuleList's experts are stored
as one [E, ...] weight per parameter, row e the model's `<list>.e.<path>` (artifacts/FORMAT.md,
Expert-parallel layout; aot/capture/listed_experts.py)."""

from __future__ import annotations

import torch


def stored_rows(stacked: dict[str, list[str]]) -> dict[str, tuple[str, int]]:
    """A stacked row's model name -> (the stacked weight, its row)."""
    return {name: (weight, row) for weight, names in stacked.items() for row, name in enumerate(names)}


def model_tensors(weights: dict[str, torch.Tensor], state: dict, missing: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every state_dict key of `state` (a manifest's or checkpoint index's `state_dict_keys`,
    `aliases`, `stacked`) whose tensor `weights` holds: a tied weight under each of its names, a
    stacked weight's rows under each expert's. Keys found nowhere are appended to `missing`."""
    aliases, rows = state.get("aliases", {}), stored_rows(state.get("stacked", {}))
    out = {}
    for key in state["state_dict_keys"]:
        source = aliases.get(key, key)
        if source in rows and rows[source][0] in weights:
            weight, row = rows[source]
            out[key] = weights[weight][row]
        elif source in weights:
            out[key] = weights[source]
        elif missing is not None:
            missing.append(key)
    return out


def held_names(state: dict) -> set[str]:
    """The stored names a state's state_dict keys read (a stacked row: its stacked weight)."""
    aliases = state.get("aliases", {})
    return stored_names((aliases.get(k, k) for k in state["state_dict_keys"]), state.get("stacked", {}))


def with_rows(weights: dict[str, torch.Tensor], stacked: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """`weights` plus, for each stacked weight it holds, each row under its model name (views)."""
    rows = {name: weights[weight][row] for name, (weight, row) in stored_rows(stacked).items() if weight in weights}
    return {**weights, **rows}


def stored_names(names, stacked: dict[str, list[str]]) -> set[str]:
    """The stored tensors that hold `names` (model names): a stacked row's weight, else the name."""
    rows = stored_rows(stacked)
    return {rows[n][0] if n in rows else n for n in names}

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
    aliases, rows = state.get("aliases", {}), stored_rows(state.get("stacked", {}))
    sources = (aliases.get(k, k) for k in state["state_dict_keys"])
    return {rows[s][0] if s in rows else s for s in sources}

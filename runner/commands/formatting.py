"""Formatting the `aot` commands share: sizes, rank lists, and the one-line descriptions of a
manifest's entries that both `aot build`'s progress and `aot inspect` print."""

from __future__ import annotations

import re
from collections import Counter

from runner.format.sharding import tp_style


def _fold_layers(name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `layers.*.mlp.up_proj.weight`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def replica_classes(entry: dict) -> dict[str, dict[str, Counter]]:
    """From the manifest's `replicas`: axis -> handling ("sharded", "reduced", "identical") ->
    parameter classes (names with layer numbers folded to *) and how many parameters each has."""
    classes: dict[str, dict[str, Counter]] = {}
    for name, handling in entry.get("params", {}).items():
        for axis, how in handling.items():
            classes.setdefault(axis, {}).setdefault(how, Counter())[_fold_layers(name)] += 1
    return classes


def describe_replicas(entry: dict) -> str:
    """One line: per mesh axis, how many parameters are sharded, reduced or identical over it."""
    classes = replica_classes(entry)
    if not classes:
        return "one copy of each parameter per rank, no axis holds replicas"
    parts = [f"{axis}: " + ", ".join(f"{sum(c.values())} {how}" for how, c in sorted(hows.items())) for axis, hows in classes.items()]
    kept = entry.get("buffers_per_rank", [])
    return "; ".join(parts) + (f"; {len(kept)} buffer(s) per rank (BatchNorm statistics, as eager DDP)" if kept else "")


def replica_lines(entry: dict) -> list[str]:
    """inspect's lines: per axis and handling, the parameter classes."""
    lines = []
    for axis, hows in replica_classes(entry).items():
        for how, classes in sorted(hows.items()):
            shown = ", ".join(f"{c} (x{n})" if n > 1 else c for c, n in classes.items())
            lines.append(f"  {axis:<5} {how:<10} {shown}")
    kept = entry.get("buffers_per_rank", [])
    if kept:
        folded = sorted({_fold_layers(n) for n in kept})
        lines.append(f"  per rank buffers: {', '.join(folded)}")
    return lines


def describe_batchnorm(entry: dict) -> str:
    """One line from the manifest's `batchnorm`: whose batch each BatchNorm layer's statistics
    are computed over (plain BatchNorm: this rank's, as eager DDP; SyncBatchNorm: the data-parallel
    group's)."""

    def layers(n: int) -> str:
        return f"{n} layer{'s' if n != 1 else ''}"

    synced, plain = entry["synced"], entry["layers"] - entry["synced"]
    over = ",".join(entry["axes"]) or "one data-parallel rank"
    parts = ([f"SyncBatchNorm over {over} ({layers(synced)})"] if synced else []) + ([f"statistics per rank ({layers(plain)})"] if plain else [])
    return "; ".join(parts)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def rank_ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))


def tp_layer(name: str, style: str) -> str:
    """A tensor-parallel layer as `aot build` and `aot inspect` name it: a fused one with its parts."""
    parts = tp_style(style)[1]
    return f"{name} ({parts} fused parts)" if parts > 1 else name


def describe_time(time: dict | None) -> str:
    """The manifest's `time`: the predicted step of one rank on the profile it was built for."""
    if not time:
        return "time       no prediction (built before aot predicted every build's step)"
    p = time["predicted"]
    recompute = f" (recomputation {p['recompute_s'] * 1e3:.3g} ms of it)" if p.get("recompute_s") else ""
    return (
        f"time       predicted {p['step_s'] * 1e3:.3g} ms per step on {time.get('topology')} "
        f"({'calibrated' if time.get('calibrated') else 'uncalibrated'}): compute {p['compute_s'] * 1e3:.3g} ms{recompute}, "
        f"communication {p['comm_s'] * 1e3:.3g} ms of which {p['exposed_comm_s'] * 1e3:.3g} ms exposed"
    )

"""`aot plan --topology a,b,c`: what-if across hardware. The model is planned on each profile by the
same search as `aot plan` (aot.plan.search.plan_model), its graphs traced once and shared where the
profiles allow (ModelSteps.retargeted), and each profile's best plan is set beside the others,
fastest first, so hardware can be chosen before anything is built."""

from __future__ import annotations

from pathlib import Path

import click

from aot import json_text
from aot.plan_tables import aligned, ms, samples_per_s, strategy_label


def what_if(model_file: Path, targets: list[tuple[str, tuple[dict, int]]], batch_size: int, options: dict, as_json: bool) -> None:
    """Plan `model_file` on each (name as given, (profile, world size)) and print the ranking."""
    from aot.plan.search import plan_model

    entries, steps = [], None
    for name, (profile, world_size) in targets:
        plans, skipped, planner, steps = plan_model(model_file, profile, world_size, batch_size, reuse=steps, **options)
        machine = planner.machine
        entries.append(
            {
                "topology": name,
                "name": machine.name,
                "nodes": machine.nodes,
                "world_size": world_size,
                "calibrated": bool(machine.calibration) or machine.compute.calibrated,
                "device_memory_bytes": machine.memory_bytes,
                "overlap": planner.overlaps,
                "plans_priced": len(plans),
                "skipped": skipped,
                # the search ranks plans that fit first: its first row is `aot plan`'s best
                "best": plans[0].row() if plans else None,
            }
        )
    assert steps is not None  # planned at least once: `aot plan` calls this with two or more targets
    entries.sort(key=rank_key)
    if as_json:
        click.echo(json_text.dumps(entries))
        return
    header = (
        f"{Path(model_file).name}: {steps.params:,} parameters, {steps.precision.compute}, "
        f"batch {batch_size} per data-parallel rank; the best plan on each of {len(entries)} topologies"
    )
    click.echo(render(entries, header, batch_size))
    first = entries[0]
    if first["best"] is not None and first["best"]["fits"]:
        click.echo(
            f"\nfastest: {first['name']} with --strategy {first['best']['strategy']}; "
            f"aot build {model_file} --topology {first['topology']} --world-size {first['world_size']} "
            f"--strategy auto"
            + "".join(f" --{option.replace('_', '-')} {options[option]}" for option in ("precision", "reduce_dtype") if options.get(option))
            + (f" --hierarchical {options['hierarchical']}" if options.get("hierarchical", "auto") != "auto" else "")
        )
    if not all(e["calibrated"] for e in entries):
        click.echo("uncalibrated profiles: absolute times are estimates (aot topology calibrate)")


def rank_key(entry: dict) -> tuple:
    """Profiles whose best plan fits first, then by predicted time per sample (the most samples
    per second: profiles of other world sizes, and plans of fewer data ranks, train on other
    batches per step); a profile with no plan last."""
    best = entry["best"]
    return (best is None, best is not None and not best["fits"], per_sample_s(best) if best else 0.0)


def per_sample_s(row: dict) -> float:
    return row["step_s"] / row["data_ranks"]


def render(entries: list[dict], header: str, batch_size: int) -> str:
    from runner.commands.formatting import human

    cols = [
        "#",
        "topology",
        "ranks",
        "strategy",
        "recompute",
        "step ms",
        "samples/s",
        "vs fastest",
        "compute ms",
        "exposed comm ms",
        "memory/rank",
        "device memory",
        "fits",
    ]
    table = [cols]
    fastest = next((per_sample_s(e["best"]) for e in entries if e["best"]), None)
    for i, e in enumerate(entries, 1):
        best = e["best"]
        device = human(e["device_memory_bytes"]) if e["device_memory_bytes"] else "-"
        if best is None:
            table.append([str(i), e["name"], str(e["world_size"]), "no plan priced", *["-"] * 7, device, "-"])
            continue
        recompute = "-" if best.get("recompute") is None else f"{best['recompute']:g}"
        table.append(
            [
                str(i),
                e["name"],
                str(e["world_size"]),
                strategy_label(best),
                recompute,
                ms(best["step_s"]),
                samples_per_s(best, batch_size),
                f"{per_sample_s(best) / fastest:.2f}x" if fastest else "-",
                ms(best["compute_s"]),
                ms(best["exposed_comm_s"]),
                human(best["memory_bytes"]["peak"]),
                device,
                "yes" if best["fits"] else "NO",
            ]
        )
    return "\n".join([header, "", *aligned(table, (cols.index("topology"), cols.index("strategy")))])

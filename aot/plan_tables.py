"""How plans are printed: `aot plan`'s ranked table, a plan's memory line, and the what-if table
(aot/plan_whatif.py) share these."""

from __future__ import annotations


def ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def samples_per_s(row: dict, batch_size: int) -> str:
    """A plan's predicted throughput: `batch_size` samples per data-parallel rank per step."""
    return f"{row['data_ranks'] * batch_size / row['step_s']:,.0f}" if row["step_s"] > 0 else "-"


def render_table(rows: list[dict], header: str, batch_size: int) -> str:
    from runner.commands.formatting import human

    cols = [
        "#",
        "strategy",
        "bucket MiB",
        "recompute",
        "step ms",
        "samples/s",
        "compute ms",
        "exposed comm ms",
        "memory/rank",
        "collectives",
        "bytes/step",
        "algorithms",
        "fits",
    ]
    left = (cols.index("strategy"), cols.index("algorithms"))
    table = [cols]
    for i, r in enumerate(rows, 1):
        algos = ", ".join(f"{n} {k}" for k, n in r["algorithms"].items()) or "-"
        recompute = recompute_label(r)
        table.append(
            [
                str(i),
                strategy_label(r),
                f"{r['bucket_mb']:g}",
                recompute,
                ms(r["step_s"]),
                samples_per_s(r, batch_size),
                ms(r["compute_s"]),
                ms(r["exposed_comm_s"]),
                human(r["memory_bytes"]["peak"]),
                str(r["collectives_per_step"]),
                human(r["collective_bytes_per_step"]),
                algos,
                "yes" if r["fits"] else "NO",
            ]
        )
    return "\n".join([header, "", *aligned(table, left)])


def recompute_label(row: dict) -> str:
    """What a plan recomputes: a pipeline's whole stages, else the activation budget, else "-"."""
    if (row.get("pipeline") or {}).get("recompute"):
        return row["pipeline"]["recompute"]
    return "-" if row.get("recompute") is None else f"{row['recompute']:g}"


def strategy_label(row: dict) -> str:
    """A plan's strategy, with its pipeline schedule where it has one."""
    pipeline = row.get("pipeline")
    return row["strategy"] + (f" ({pipeline['schedule']}, {pipeline['microbatches']} microbatches)" if pipeline else "")


def aligned(table: list[list[str]], left: tuple[int, ...]) -> list[str]:
    """A table's lines: the first row a heading underlined, columns right-aligned but `left`."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for k, row in enumerate(table):
        lines.append("  ".join(cell.rjust(widths[i]) if i not in left else cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def describe_memory(row: dict) -> str:
    """One line: a plan's predicted memory per rank, itemized (what stays for the whole step, then
    what is live at the peak)."""
    from runner.commands.formatting import human

    m = row["memory_bytes"]
    resident = [("parameters", m["params"]), ("optimizer state", m["optimizer"]), ("buffers", m["buffers"]), ("batch", m["batch"])]
    at_peak = [(part.replace("_", " "), n) for part, n in m["at_peak"].items()]
    line = (
        f"peak {human(m['peak'])} per rank: "
        + ", ".join(f"{name} {human(n)}" for name, n in resident if n or name in ("parameters", "optimizer state"))
        + "; at the peak "
        + ", ".join(f"{name} {human(n)}" for name, n in at_peak if n or name in ("activations", "gradients", "collective buffers"))
    )
    if m["activations_peak"] > m["at_peak"]["activations"]:
        line += f" (activations at their own peak {human(m['activations_peak'])})"
    return line

"""Options more than one command takes (`aot build`, `aot plan`), declared once: the same name,
type, choices and default everywhere; each command says in its own words what the option does there."""

from __future__ import annotations

import click

PRECISIONS = ("fp32", "bf16", "fp16")  # aot.capture.precision.DTYPES' names (imported here without torch)
HIERARCHICAL = ("auto", "always", "never")  # aot.plan.hierarchy.chooser's modes


def nodes(help: str):
    return click.option("--nodes", type=int, default=None, help=help)


def world_size(help: str):
    return click.option("--world-size", type=int, default=None, help=help)


batch_size = click.option("--batch-size", type=int, default=8, show_default=True, help="Samples per data-parallel rank per step.")


def seed(help: str | None = None):
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def sequence_parallel(help: str):
    return click.option("--sequence-parallel", is_flag=True, help=help)


def moe_capacity_factor(help: str):
    return click.option("--moe-capacity-factor", type=float, default=None, help=help)


def hierarchical(help: str):
    return click.option("--hierarchical", type=click.Choice(HIERARCHICAL), default="auto", show_default=True, help=help)


def precision(help: str):
    return click.option("--precision", type=click.Choice(PRECISIONS), default=None, help=help)


def reduce_dtype(help: str):
    return click.option("--reduce-dtype", type=click.Choice(PRECISIONS), default=None, help=help)

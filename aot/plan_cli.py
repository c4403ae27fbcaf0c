"""`aot plan` (rank candidate plans for a model on a topology) and `aot topology calibrate`
(measure a profile's alpha, beta and compute rates on the live ranks). Registered by aot/cli.py."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import click

from aot import cli_options as options
from aot import json_text
from aot.garbage_collection import DEFERRED, collected_less_often
from aot.plan_tables import describe_memory, render_table
from runner.commands.console import debug_option


SKIPPED_SHOWN = 8  # meshes not priced listed in the table's text (all in --json)


@click.command("plan")
@click.argument("model_file", type=click.Path(path_type=Path))
@click.option(
    "--topology",
    metavar="PROFILE[,PROFILE...]",
    help="Built-in profile name, profile JSON file or artifact folder. Default: this machine. Several, "
    "comma-separated (--topology dgx_a100,dgx_h100,hgx_h200): what-if across hardware, the best plan "
    "on each, fastest first.",
)
@options.nodes("Nodes the job spans. Default: the profile's node count.")
@options.world_size("Ranks. Default: every GPU of every node (cpu profiles: one rank per node).")
@options.batch_size
@click.option(
    "--bucket-mb",
    "bucket_mbs",
    type=float,
    multiple=True,
    help="Gradient bucket size to consider, in MiB (repeatable). Default: 1, 4, 25, 100 and the model's gradients split in 2, 4 and 8.",
)
@options.seed("The seed `aot build --seed` records the weights with.")
@click.option(
    "--axes",
    default=None,
    help="Parallel axes to search, comma-separated (default: dp,fsdp,tp,pp, as `aot build --strategy "
    "auto` searches, with pipeline meshes made from the best plans without pp and priced only where "
    "they could rank first: where no plan without pp fits, or where they could fit (a pipeline rank "
    "holds 1/pp of the model's gradients whole at the least) and a lower bound of their time per "
    "sample beats the best plan's). Each tensor-parallel degree the "
    "model takes costs one trace of the step and a shorter one of its optimizer (about a second "
    "each); the default search prices a tp degree's meshes only where its step's compute ops alone "
    "could beat the two fastest meshes that fit, and naming the axes prices them all. "
    "--axes dp,fsdp searches without tp. Naming pp prices every pipeline mesh (pp outermost; "
    "1f1b, interleaved-1f1b and zero-bubble at 1, 2 and 4 microbatches per pipeline rank; every pipeline rank's "
    "program is traced, so it takes about ten times longer: minutes for an 8B model).",
)
@options.sequence_parallel("Price tensor-parallel meshes with sequence parallelism, as `aot build --sequence-parallel` builds them.")
@options.hierarchical(
    "Price all_reduces over groups that span nodes in two levels (reduce-scatter inside a node, "
    "all_reduce across nodes, all-gather): where cheaper, always, or never; as `aot build --hierarchical`.",
)
@options.precision(
    "Price the step as `aot build --precision` builds it (smaller activations and collectives, "
    "matmuls at the profile's bf16/fp16 rate). Default: the model file's `precision`, else fp32.",
)
@options.reduce_dtype("Dtype gradients are reduced in, as `aot build --reduce-dtype`.")
@options.moe_capacity_factor("Price ep meshes with this expert capacity, as `aot build --moe-capacity-factor` builds them (default: dropless).")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes that plan at once: each traces some of the model's layout classes (a "
    "tensor-parallel degree, with and without fsdp), then prices some of the meshes and pipeline "
    "meshes. Default: AOT_PLAN_WORKERS, else one per core this process may use and 1.5 GiB of "
    "available memory (forked, on Linux; elsewhere 1); 1 plans in this process. The plans are the "
    "same either way.",
)
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows to print.")
@click.option("--json", "as_json", is_flag=True, help="Print every candidate as JSON.")
@debug_option
# as plan_model collects (aot/garbage_collection.py), until the command ends: its objects live that
# long, and no full collection walks them all as it ends (2.4 s of 45 planning Llama-3-70B in one
# process)
@collected_less_often(young=50_000, middle=DEFERRED)
def plan(
    model_file,
    topology,
    nodes,
    world_size,
    batch_size,
    bucket_mbs,
    seed,
    axes,
    sequence_parallel,
    hierarchical,
    precision,
    reduce_dtype,
    moe_capacity_factor,
    workers,
    top,
    as_json,
):
    """Rank the ways to train MODEL_FILE on a topology, before any GPU is used.

    Traces the step a few times, then prices every candidate plan (parallel degrees among the axes the
    build supports, gradient bucket sizes, placement of the mesh on the machine) with the cost
    model: compute per graph node as a roofline of the profile's peak FLOP/s and memory bandwidth,
    collectives with alpha-beta models of ring and tree algorithms over the links each group spans,
    overlap of communication with backward, and peak memory per rank from graph liveness (itemized:
    parameters, optimizer state, and activations, gradients and collective buffers at the peak;
    every part in --json). Plans that do not fit device memory are marked and never chosen; each is
    also priced recomputing activations (the `recompute` column: the activation budget, as
    `aot build --activation-budget`), which ranks with the rest. `aot build --strategy auto` builds
    the first row that fits. Calibrate the profile first (`aot topology calibrate`) for absolute times.

    With several profiles (`--topology dgx_a100,dgx_h100,hgx_h200`) it plans the model on each, the
    graphs traced once and shared where the profiles allow, and prints one row per profile: its
    best plan, predicted step time, memory per rank and exposed communication, fastest first
    (--json: a list, one entry per profile, in that order). Each row is what `aot plan` prints
    first for that profile alone.
    """
    from aot.errors import AotError
    from aot.plan.mesh import BUILD_AXES
    from aot.plan.search import MEMORY_HEADROOM, plan_model
    from runner.commands.formatting import human
    from runner.hardware.nvml_probe import live_profile
    from runner.hardware.topology import every_rank, for_nodes, load_profile

    started = time.perf_counter()

    def target(name: str | None) -> tuple[dict, int]:
        profile = load_profile(name) if name else live_profile()
        profile = for_nodes(profile, nodes)
        ranks = world_size
        if ranks is None:
            ranks = every_rank(profile)
        if ranks < 1:
            raise AotError(f"--world-size must be at least 1, got {ranks}")
        return for_nodes(profile, None, ranks), ranks

    # every profile loaded before any is planned: a wrong name in a list fails at once
    names = [name.strip() for name in topology.split(",")] if topology else []
    targets = [target(name) for name in names] or [target(None)]  # none named: this machine's own
    searched = tuple(a.strip() for a in axes.split(",") if a.strip()) if axes is not None else None
    if searched is not None and (not searched or any(a not in BUILD_AXES for a in searched)):
        raise AotError(f"--axes {axes!r}: expected some of {', '.join(BUILD_AXES)}")
    options = dict(
        seed=seed,
        bucket_mbs=tuple(bucket_mbs) or None,
        axes=searched,
        sequence_parallel=sequence_parallel,
        hierarchical=hierarchical,
        precision=precision,
        reduce_dtype=reduce_dtype,
        moe_capacity_factor=moe_capacity_factor,
        workers=workers,
    )
    if moe_capacity_factor is not None and not moe_capacity_factor > 0:
        raise AotError(f"--moe-capacity-factor must be positive, got {moe_capacity_factor:g}")
    if len(targets) > 1:
        from aot.plan_whatif import what_if

        what_if(model_file, list(zip(names, targets)), batch_size, options, as_json)
        if not as_json:
            click.echo(f"planned in {time.perf_counter() - started:.1f} s", err=True)
        return
    [(profile, world_size)] = targets
    # what is being traced, as it starts, where someone watches (a terminal; a log gets the summary line)
    note = (lambda line: click.echo(line, err=True)) if sys.stderr.isatty() else None
    plans, skipped, planner, steps = plan_model(model_file, profile, world_size, batch_size, note=note, **options)
    machine = planner.machine
    seconds = time.perf_counter() - started
    spent = time_spent(seconds, steps.seconds)
    rows = [p.row() for p in plans]
    if as_json:
        click.echo(
            json_text.dumps(
                {
                    "model_file": str(model_file),
                    "topology": machine.name,
                    "nodes": machine.nodes,
                    "world_size": world_size,
                    "batch_size": batch_size,
                    "parameters": steps.params,
                    "precision": steps.precision.to_json(),
                    "calibrated": bool(machine.calibration) or machine.compute.calibrated,
                    "overlap": planner.overlaps,
                    "device_memory_bytes": machine.memory_bytes,
                    "memory_headroom": MEMORY_HEADROOM,
                    "seconds": round(seconds, 3),
                    "time": spent,
                    "workers": steps.workers,
                    "skipped": skipped,
                    "plans": rows,
                },
            )
        )
        return
    calibrated = "calibrated" if (machine.calibration or machine.compute.calibrated) else "uncalibrated: absolute times are estimates"
    header = (
        f"{Path(model_file).name}: {steps.params:,} parameters, {steps.precision.compute}, "
        f"batch {batch_size} per data-parallel rank, "
        f"{world_size} rank(s) on {machine.describe()} ({calibrated})"
    )
    click.echo(render_table(rows[:top], header, batch_size))
    if len(rows) > top:
        click.echo(f"... {len(rows) - top} more (--top, --json)")
    for line in skipped[:SKIPPED_SHOWN]:
        click.echo(f"not priced: {line}")
    if len(skipped) > SKIPPED_SHOWN:  # thousands of ranks leave dozens of meshes tp cannot take
        click.echo(f"... {len(skipped) - SKIPPED_SHOWN} more meshes not priced (--json lists each with its reason)")
    if plans:
        best = next((p for p in plans if p.fits), None)
        if best is not None:
            click.echo(
                f"\nbest: --strategy {best.strategy} --bucket-mb {best.bucket_mb:g}"
                + (f" --activation-budget {best.recompute:g}" if best.recompute is not None else "")
                + (
                    f" --microbatches {best.pipeline['microbatches']} --pp-schedule {best.pipeline['schedule']}"
                    + (f" --stages-per-rank {best.pipeline['stages_per_rank']}" if best.pipeline["stages_per_rank"] > 1 else "")
                    if best.pipeline
                    else ""
                )
                + (f" (NCCL_ALGO={best.nccl_algo})" if best.nccl_algo else "")
                + f"; aot build {model_file} --topology {topology or 'live'} --world-size {world_size} --strategy auto"
                + (f" --hierarchical {hierarchical}" if hierarchical != "auto" else "")
                + (f" --precision {precision}" if precision else "")
                + (f" --reduce-dtype {reduce_dtype}" if reduce_dtype else "")
            )
            click.echo(f"memory of #{plans.index(best) + 1}: {describe_memory(best.row())}")
            if best.recompute is not None:
                without = next((p for p in plans if p.recompute is None and p.strategy == best.strategy and p.bucket_mb == best.bucket_mb), None)
                click.echo(
                    f"recomputing activations (keeping at most {best.recompute:g} of the saved activation bytes)"
                    + (
                        f"; without: peak {human(without.prediction.memory.peak)}, over the {human(int(MEMORY_HEADROOM * machine.memory_bytes))} usable"
                        if without and machine.memory_bytes
                        else ""
                    )
                )
        else:
            click.echo("\nno plan fits the device memory")
            smallest = min(range(len(plans)), key=lambda i: plans[i].prediction.memory.peak)
            click.echo(f"memory of #{smallest + 1} (the smallest peak): {describe_memory(rows[smallest])}")
    parts = ", ".join(f"{part[:-2].replace('_', ' ')} {s:.1f} s" for part, s in spent.items() if part != "total_s")
    workers = f" by {steps.workers} worker processes" if steps.workers > 1 else ""
    click.echo(f"planned in {seconds:.1f} s{workers} ({parts})", err=True)


def time_spent(total: float, parts: dict[str, float]) -> dict[str, float]:
    """Where planning's time went (`--json`'s "time"): recording the model (model() and its
    optimizer on fake tensors), tracing the step's graphs, making the graphs that recompute
    activations (those a plan may need to fit device memory), tracing pipeline programs, and the
    rest (pricing every candidate, placing meshes, the search)."""
    tracing = parts["tracing"] - parts["recomputing"]
    spent = {"recording_s": parts["recording"], "tracing_s": tracing, "recomputing_s": parts["recomputing"], "pipeline_programs_s": parts["pipelines"]}
    spent["pricing_s"] = max(0.0, total - sum(spent.values()))
    return {"total_s": round(total, 3), **{part: round(s, 3) for part, s in spent.items()}}


@click.command("calibrate")
@click.option("--profile", "base", metavar="PROFILE", help="Profile to calibrate (built-in name, file or artifact). Default: this machine (probed).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Calibrated profile to write (rank 0).")
@click.option("--name", help="Name of the calibrated profile. Default: the base profile's name + '-calibrated'.")
@click.option("--min-bytes", type=click.IntRange(min=4), default=4096, show_default=True, help="Smallest message.")
@click.option("--max-bytes", type=click.IntRange(min=4), default=None, help="Largest message. Default: 16 MiB on cpu ranks, 256 MiB on GPUs.")
@click.option("--reps", type=click.IntRange(min=1), default=7, show_default=True, help="Least timed repetitions per size.")
@click.option(
    "--min-seconds",
    type=click.FloatRange(min=0),
    default=0.25,
    show_default=True,
    help="Keep repeating each size until this long has been timed (at most 400 times): a small "
    "CPU collective's time is bimodal, and a few repetitions land in either mode.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Rounds of compute (and, on CPU ranks, in-step stall) measurements; each figure is the median "
    "over rounds. Default: 5 on CPU ranks (a shared machine's speed drifts from one ten seconds "
    "to the next), 1 on GPUs.",
)
@debug_option
def calibrate(base, output, name, min_bytes, max_bytes, reps, min_seconds, rounds):
    """Measure this machine's collectives and compute and write them into a profile copy.

    Run under torchrun with one process per rank the profile describes:

    \b
        torchrun --nproc-per-node 2 -m aot topology calibrate --profile cpu -o cpu-calibrated.json
        aot plan examples/gpt.py --topology cpu-calibrated.json --world-size 2

    alpha (seconds per message) and beta (seconds per byte) of all_reduce, all_gather and
    reduce_scatter are fitted over message sizes and read through each kind's ring formula, and
    those of one point-to-point transfer between ranks 0 and 1 (send_recv: what a pipeline's
    stages pay to pass activations and gradients); matrix
    multiply FLOP/s, memory bandwidth and the cost of one op in a graph are measured on every rank
    at once. They go into the profile's `calibration` (per link class, with a per-kind table) and
    `compute` entries, which `aot plan` and `aot build --strategy auto` use.

    On CPU ranks it also measures what a blocking collective costs inside a step, per kind and
    after runs of compute up to ~20 ms, in 5 rounds: about 1.5 minutes at 2 ranks and 2.5 at 4 on
    a 2-core machine. Calibrate right before the runs the profile should predict: a shared
    machine's speed drifts over minutes.
    """
    from runner.errors import AotError
    from runner.format.integrity import check_writable_target
    from runner.hardware.nvml_probe import live_profile
    from runner.hardware.topology import dumps_profile, load_profile, validate_profile

    from aot.plan.calibrate import calibrate as run_calibration

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        check_writable_target(output, "file")
    profile = load_profile(base) if base else live_profile()
    profile = {k: v for k, v in profile.items() if k not in ("nodes_unknown",)}
    if max_bytes is None:
        max_bytes = 256 * 2**20 if profile["device_kind"] == "cuda" else 16 * 2**20
    if max_bytes < min_bytes:
        raise AotError(f"--max-bytes {max_bytes} is below --min-bytes {min_bytes}")
    log = (lambda msg: click.echo(msg, err=True)) if rank == 0 else (lambda msg: None)
    result = run_calibration(profile, min_bytes=min_bytes, max_bytes=max_bytes, reps=reps, min_seconds=min_seconds, rounds=rounds, log=log)
    if result is None:
        return
    result["name"] = name or f"{profile['name']}-calibrated"
    validate_profile(result, str(output))
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(dumps_profile(result))
        os.replace(tmp, output)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise AotError(f"{output}: cannot write ({e.strerror})") from None
    for cls, entry in (result.get("calibration") or {}).items():
        for kind, ab in (entry.get("per_kind") or {}).items():
            log(
                f"{cls:<8} {kind:<15} alpha {ab['alpha_s'] * 1e6:8.2f} us  beta {ab['beta_s_per_byte']:.3g} s/B "
                f"({1 / ab['beta_s_per_byte'] / 1e9 if ab['beta_s_per_byte'] else float('inf'):.3g} GB/s)"
            )
    c = result["compute"]
    log(
        f"compute  {', '.join(f'{k} {v / 1e9:.3g} GFLOP/s' for k, v in c['flops_per_s'].items())}, "
        f"memory {c['memory_bytes_per_s'] / 1e9:.3g} GB/s, {c['op_overhead_s'] * 1e6:.2f} us per op"
        + (
            f" beyond its call ({len(c['dispatch_s'])} ops' calls timed, median {statistics.median(one for one, _ in c['dispatch_s'].values()) * 1e6:.1f} us)"
            if c.get("dispatch_s")
            else ""
        )
        + f", {c['efficiency']:.0%} of that roofline on real ops"
    )
    for kind, table in (c.get("collective_stall_by_kind") or {"collective": c.get("collective_stall_by_segment") or ()}).items():
        for seconds, stall in table:
            slow = sum(1 for t in stall if t > 1e-3) / len(stall)
            log(
                f"in-step  after {seconds * 1e3:6.2f} ms of compute a blocking {kind:<14} stalls {sum(stall) / len(stall) * 1e3:5.2f} ms "
                f"on average (median {stall[len(stall) // 2] * 1e3:5.2f} ms; {slow:.0%} over 1 ms)"
            )
    log(f"wrote {result['name']!r} to {output}")
